//! The user namespace of runc sandboxes, and the files it needs: sandbox root is not host root.
//!
//! # One range per host
//! Every runc sandbox of a machine runs in its own user namespace whose ids `0..65536` map to
//! the host ids [`SANDBOX_IDS`] (`1073741824..1073807360`, uid and gid alike). None of those
//! is a user of the host (`useradd` hands out subordinate ranges from 100000 in blocks of
//! 65536), so a process that leaves its sandbox owns nothing of the host and holds no
//! capability over it: the capabilities it has inside are those of its user namespace, over
//! inodes whose owner maps into it.
//!
//! Per host, not per sandbox, because runc 1.1 cannot idmap mounts: every file a sandbox sees
//! must be owned, on the host, by an id of its range, so the template lower dirs are copied
//! once with shifted ownership ([`shifted_template`]) and shared by all sandboxes of the
//! machine. A range per sandbox would need a shifted copy of the template per sandbox (the
//! `python` template is a Debian root, hundreds of MiB) or idmapped lower layers, which runc
//! 1.1 does not set up. What the per-host range does not give: two sandboxes on one machine
//! share host ids, which matters only to a process that has already left its sandbox; the
//! network (own namespace, nftables), pid, mount and IPC namespaces still separate them.
//!
//! # What changes inside
//! Nothing for the sandbox: its root is uid 0 with the same capability set, the template's
//! files keep their owners (shifted on the host only), and files it writes are its own. Its
//! network namespace is owned by the host's user namespace, so the sandbox has no
//! `CAP_NET_ADMIN` or `CAP_NET_RAW` there (no raw sockets, no address or route changes), and
//! no sysfs of its own: `/sys` is an empty read-only tmpfs (`crate::oci`). ICMP echo still
//! works through unprivileged ICMP sockets: [`allow_ping_sockets`] opens
//! `net.ipv4.ping_group_range` in the sandbox's network namespace.
//!
//! gVisor sandboxes are not put in a user namespace of ours: runsc already runs the sentry and
//! the gofer as an unprivileged user in a user namespace of its own, and the sandbox's
//! "root" is root of gVisor's kernel only.
//!
//! Source: user_namespaces(7) (mappings, capabilities over inodes), chown(2) (set-user-ID bits
//! cleared on chown), runc 1.1 (`linux.uidMappings`, no `idmap` mount option).

use std::fs;
use std::os::unix::fs::{lchown, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::HostdError;

/// A contiguous id range: ids `0..size` inside map to `host_base..host_base + size` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    /// The host id of the sandbox's id 0.
    pub host_base: u32,
    /// How many ids are mapped.
    pub size: u32,
}

/// The ids of every runc sandbox of a machine (see the module docs).
pub const SANDBOX_IDS: IdRange = IdRange {
    host_base: 1 << 30,
    size: 65536,
};

/// The id inside given to a file whose id does not fit the range (`nobody`).
pub const OVERFLOW_ID: u32 = 65534;

/// The value of `net.ipv4.ping_group_range` in a sandbox's network namespace: every group may
/// open ICMP echo sockets (`socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP)`), the way `ping` works
/// without `CAP_NET_RAW`. The namespace holds one sandbox, so this opens nothing to others.
pub const PING_GROUP_RANGE: &str = "0 2147483647";

impl IdRange {
    /// The host id of id `id` inside; [`OVERFLOW_ID`]'s host id when `id` does not fit.
    pub fn to_host(&self, id: u32) -> u32 {
        let inside = if id < self.size { id } else { OVERFLOW_ID };
        self.host_base + inside
    }

    /// Whether host id `id` is one of the range's.
    pub fn holds(&self, id: u32) -> bool {
        id >= self.host_base && id - self.host_base < self.size
    }
}

/// Gives every file below `root` (and `root` itself, last) the host ids of its ids inside
/// `range`: uid `u` becomes `range.to_host(u)`, the same for gids. Files already owned by ids
/// of the range are left alone, so an interrupted shift can simply be run again, and hard
/// links are shifted once. Set-user-ID and set-group-ID bits, which `chown` clears, are put
/// back. File capabilities (`security.capability`) are lost: the kernel drops them on chown.
///
/// Errors: [`HostdError::Io`] naming the file.
pub fn shift_tree(root: &Path, range: IdRange) -> Result<(), HostdError> {
    let meta =
        fs::symlink_metadata(root).map_err(HostdError::io(format!("stat {}", root.display())))?;
    if meta.is_dir() {
        let entries =
            fs::read_dir(root).map_err(HostdError::io(format!("list {}", root.display())))?;
        for entry in entries {
            let entry = entry.map_err(HostdError::io(format!("list {}", root.display())))?;
            shift_tree(&entry.path(), range)?;
        }
    }
    shift_one(root, &meta, range)
}

fn shift_one(path: &Path, meta: &fs::Metadata, range: IdRange) -> Result<(), HostdError> {
    let (uid, gid) = (meta.uid(), meta.gid());
    let uid = (!range.holds(uid)).then(|| range.to_host(uid));
    let gid = (!range.holds(gid)).then(|| range.to_host(gid));
    if uid.is_none() && gid.is_none() {
        return Ok(());
    }
    lchown(path, uid, gid).map_err(HostdError::io(format!("chown {}", path.display())))?;
    let mode = meta.permissions().mode();
    if meta.is_file() && mode & 0o6000 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(HostdError::io(format!("chmod {}", path.display())))?;
    }
    Ok(())
}

/// The shifted copy of template root `rootfs` for `range`: `<rootfs>.ids-<host_base>` beside
/// it, made once per template and machine (under a lock file, so hostd processes sharing a
/// template cache make it once) by `cp -a` into a temporary dir, [`shift_tree`], and a rename
/// into place. Returns at once when the copy exists.
///
/// A template is never changed once built (`template` renames whole builds into place), so
/// the copy stays true to it.
///
/// Errors: [`HostdError::Io`], [`HostdError::Tool`] (`cp`).
pub fn shifted_template(rootfs: &Path, range: IdRange) -> Result<PathBuf, HostdError> {
    let name = rootfs
        .file_name()
        .ok_or_else(|| HostdError::Io {
            context: format!("template root {} has no name", rootfs.display()),
            source: std::io::ErrorKind::InvalidInput.into(),
        })?
        .to_string_lossy()
        .into_owned();
    let shifted = rootfs.with_file_name(format!("{name}.ids-{}", range.host_base));
    if shifted.is_dir() {
        return Ok(shifted);
    }
    let parent = rootfs.parent().unwrap_or(Path::new("/"));
    let lock_path = parent.join(format!(".{name}.ids-{}.lock", range.host_base));
    let lock = fs::File::create(&lock_path)
        .map_err(HostdError::io(format!("create {}", lock_path.display())))?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| HostdError::io(format!("lock {}", lock_path.display()))(e.into()))?;
    if shifted.is_dir() {
        return Ok(shifted);
    }
    let started = std::time::Instant::now();
    let tmp = parent.join(format!(
        ".{name}.ids-{}.tmp-{}",
        range.host_base,
        uuid::Uuid::new_v4().simple()
    ));
    let made = copy_tree(rootfs, &tmp)
        .and_then(|()| shift_tree(&tmp, range))
        .and_then(|()| {
            fs::rename(&tmp, &shifted).map_err(HostdError::io(format!(
                "rename {} into place",
                tmp.display()
            )))
        });
    if made.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    made?;
    tracing::info!(template = %rootfs.display(), elapsed = ?started.elapsed(), "template shifted to the sandbox id range");
    Ok(shifted)
}

/// `cp -a --reflink=auto src dst` (modes, owners, times, links, xattrs, hard links kept).
fn copy_tree(src: &Path, dst: &Path) -> Result<(), HostdError> {
    let out = std::process::Command::new("cp")
        .args(["-a", "--reflink=auto", "--"])
        .arg(src)
        .arg(dst)
        .output()
        .map_err(HostdError::io("spawn cp"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HostdError::Tool {
            program: "cp".into(),
            args: format!("-a {} {}", src.display(), dst.display()),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Whether `upper` exists and is owned (uid and gid) by ids of `range`.
///
/// Errors: [`HostdError::Io`] other than a missing dir.
pub fn owns_upper(upper: &Path, range: IdRange) -> Result<bool, HostdError> {
    match fs::metadata(upper) {
        Ok(meta) => Ok(range.holds(meta.uid()) && range.holds(meta.gid())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(HostdError::io(format!("stat {}", upper.display()))(e)),
    }
}

/// Makes a sandbox's overlay upper dir its own: creates it if missing and, when it is not
/// owned by an id of `range` (a new dir, or one written before sandboxes had a user
/// namespace), shifts it and everything in it ([`shift_tree`], the dir itself last). Returns
/// whether anything was shifted. Call it only while no container uses the dir.
///
/// Errors: [`HostdError::Io`].
pub fn own_upper(upper: &Path, range: IdRange) -> Result<bool, HostdError> {
    fs::create_dir_all(upper).map_err(HostdError::io(format!("create {}", upper.display())))?;
    if owns_upper(upper, range)? {
        return Ok(false);
    }
    shift_tree(upper, range)?;
    Ok(true)
}

/// Sets `net.ipv4.ping_group_range` to [`PING_GROUP_RANGE`] in the network namespace at
/// `netns_path`, from a short-lived thread that joins it (a sysctl under `/proc/sys/net`
/// belongs to the namespace of whoever opens it). The sandbox cannot set it itself: its user
/// namespace does not own its network namespace.
///
/// Errors: [`HostdError::Io`].
pub fn allow_ping_sockets(netns_path: &Path) -> Result<(), HostdError> {
    let path = netns_path.to_path_buf();
    std::thread::spawn(move || -> Result<(), HostdError> {
        let ns =
            fs::File::open(&path).map_err(HostdError::io(format!("open {}", path.display())))?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| HostdError::io(format!("join {}", path.display()))(e.into()))?;
        fs::write("/proc/sys/net/ipv4/ping_group_range", PING_GROUP_RANGE).map_err(HostdError::io(
            format!("set ping_group_range in {}", path.display()),
        ))
    })
    .join()
    .map_err(|_| HostdError::Io {
        context: "ping_group_range thread panicked".into(),
        source: std::io::Error::other("panic"),
    })?
}

/// Checks that every directory from `/` down to `dir` (which must exist) can be searched by
/// other users: a user-namespaced sandbox's root is an unprivileged host uid, and runc mounts
/// its root filesystem from inside that namespace.
///
/// Errors: [`HostdError::StateDirNotSearchable`] naming the first directory that is not;
/// [`HostdError::Io`] when `dir` cannot be resolved.
pub fn check_searchable(dir: &Path) -> Result<(), HostdError> {
    use std::os::unix::fs::PermissionsExt;
    let dir =
        std::fs::canonicalize(dir).map_err(HostdError::io(format!("resolve {}", dir.display())))?;
    for ancestor in dir.ancestors() {
        let mode = std::fs::metadata(ancestor)
            .map_err(HostdError::io(format!("stat {}", ancestor.display())))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            return Err(HostdError::StateDirNotSearchable {
                path: ancestor.to_path_buf(),
                mode: mode & 0o7777,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn a_state_dir_below_a_private_directory_is_refused_with_the_directory_named() {
        use std::os::unix::fs::PermissionsExt;
        let top = scratch();
        let private = top.join("private");
        let state = private.join("hostd");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        match check_searchable(&state) {
            Err(HostdError::StateDirNotSearchable { path, mode }) => {
                assert_eq!(path, std::fs::canonicalize(&private).unwrap());
                assert_eq!(mode, 0o700);
            }
            other => panic!("{other:?}"),
        }
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o711)).unwrap();
        check_searchable(&state).unwrap();
        std::fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn ids_map_into_the_range_and_overflow_to_nobody() {
        let r = SANDBOX_IDS;
        assert_eq!(r.to_host(0), 1 << 30);
        assert_eq!(r.to_host(1000), (1 << 30) + 1000);
        assert_eq!(r.to_host(70000), (1 << 30) + OVERFLOW_ID);
        assert!(r.holds(1 << 30) && r.holds((1 << 30) + 65535));
        assert!(!r.holds(0) && !r.holds((1 << 30) + 65536) && !r.holds((1 << 30) - 1));
    }

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-ids-{}", uuid::Uuid::new_v4()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_template_is_copied_once_with_shifted_owners_and_kept_modes() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: needs root to chown");
            return;
        }
        let dir = scratch();
        let root = dir.join("rootfs");
        fs::create_dir_all(root.join("home/user")).unwrap();
        fs::write(root.join("suid"), b"x").unwrap();
        fs::set_permissions(root.join("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
        lchown(root.join("home/user"), Some(1000), Some(100)).unwrap();
        fs::hard_link(root.join("suid"), root.join("suid-link")).unwrap();
        symlink("suid", root.join("link")).unwrap();

        let shifted = shifted_template(&root, SANDBOX_IDS).unwrap();
        assert_eq!(shifted, dir.join(format!("rootfs.ids-{}", 1u32 << 30)));
        let base = 1u32 << 30;
        let m = |p: &str| fs::symlink_metadata(shifted.join(p)).unwrap();
        assert_eq!((m("").uid(), m("").gid()), (base, base));
        assert_eq!(
            (m("home/user").uid(), m("home/user").gid()),
            (base + 1000, base + 100)
        );
        assert_eq!(m("suid").uid(), base);
        assert_eq!(m("suid").permissions().mode() & 0o7777, 0o4755);
        assert_eq!(m("suid").ino(), m("suid-link").ino());
        assert_eq!(m("link").uid(), base);
        // The original is untouched, and a second call reuses the copy.
        assert_eq!(fs::metadata(root.join("home/user")).unwrap().uid(), 1000);
        fs::write(shifted.join("marker"), b"").unwrap();
        assert_eq!(shifted_template(&root, SANDBOX_IDS).unwrap(), shifted);
        assert!(shifted.join("marker").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_upper_dir_is_shifted_once_and_a_partly_shifted_one_is_finished() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: needs root to chown");
            return;
        }
        let dir = scratch();
        let upper = dir.join("upper");
        fs::create_dir_all(upper.join("root")).unwrap();
        fs::write(upper.join("root/old"), b"").unwrap();
        let base = 1u32 << 30;
        // As if a shift was interrupted after this one file.
        lchown(upper.join("root/old"), Some(base), Some(base)).unwrap();
        assert!(own_upper(&upper, SANDBOX_IDS).unwrap());
        for p in ["", "root", "root/old"] {
            let m = fs::symlink_metadata(upper.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (base, base), "{p}");
        }
        assert!(!own_upper(&upper, SANDBOX_IDS).unwrap());
        let fresh = dir.join("fresh");
        assert!(own_upper(&fresh, SANDBOX_IDS).unwrap());
        assert_eq!(fs::metadata(&fresh).unwrap().uid(), base);
        fs::remove_dir_all(&dir).unwrap();
    }
}
