use std::os::unix::fs::{symlink, FileTypeExt};

use super::*;

/// One entry of a test layer.
enum E<'a> {
    File(&'a str, &'a [u8]),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
    HardLink(&'a str, &'a str),
    CharDevice(&'a str),
}

/// A plain tar layer of `entries`; names are written raw, so `..` and absolute paths go in
/// as a hostile layer would have them.
fn layer(dir: &Path, name: &str, entries: &[E]) -> PathBuf {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut h = tar::Header::new_gnu();
        let (path, data): (&str, &[u8]) = match entry {
            E::File(p, d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                (p, d)
            }
            E::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                (p, b"")
            }
            E::Symlink(p, target) | E::HardLink(p, target) => {
                h.set_entry_type(if matches!(entry, E::Symlink(..)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                h.set_mode(0o777);
                let link = &mut h.as_gnu_mut().unwrap().linkname;
                link[..target.len()].copy_from_slice(target.as_bytes());
                (p, b"")
            }
            E::CharDevice(p) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_mode(0o666);
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
                (p, b"")
            }
        };
        let raw = &mut h.as_gnu_mut().unwrap().name;
        raw[..path.len()].copy_from_slice(path.as_bytes());
        h.set_size(data.len() as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        builder.append(&h, data).unwrap();
    }
    let path = dir.join(name);
    fs::write(&path, builder.into_inner().unwrap()).unwrap();
    path
}

struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("berth-unpack-{}", uuid::Uuid::new_v4()));
        fs::create_dir_all(dir.join("root")).unwrap();
        Self(dir)
    }
    fn root(&self) -> PathBuf {
        self.0.join("root")
    }
    fn apply(&self, blob: &Path) -> Result<(), ImageError> {
        apply_layer(
            &self.root(),
            blob,
            Compression::None,
            &ROOMY,
            &mut Unpacked::default(),
        )
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

const ROOMY: UnpackLimits = UnpackLimits {
    max_bytes: 1 << 20,
    max_entries: 1000,
};

fn assert_hostile(result: Result<(), ImageError>, why: &str) {
    match result {
        Err(ImageError::Hostile { reason, .. }) => assert!(reason.contains(why), "{reason}"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    }
}

#[test]
fn whiteouts_delete_lower_files_and_opaque_dirs_hide_lower_children() {
    let s = Scratch::new();
    let lower = layer(
        &s.0,
        "lower",
        &[
            E::Dir("etc/"),
            E::File("etc/keep", b"keep"),
            E::File("etc/gone", b"gone"),
            E::Dir("data/"),
            E::File("data/old", b"old"),
            E::Dir("data/sub/"),
            E::File("data/sub/deep", b"deep"),
        ],
    );
    // The opaque marker comes after the layer's own entry of that dir: the own entry stays.
    let upper = layer(
        &s.0,
        "upper",
        &[
            E::File("etc/.wh.gone", b""),
            E::Dir("data/"),
            E::File("data/new", b"new"),
            E::File("data/.wh..wh..opq", b""),
            E::File("etc/.wh.never-existed", b""),
        ],
    );
    s.apply(&lower).unwrap();
    s.apply(&upper).unwrap();
    let root = s.root();
    assert_eq!(fs::read(root.join("etc/keep")).unwrap(), b"keep");
    assert!(!root.join("etc/gone").exists());
    assert_eq!(fs::read(root.join("data/new")).unwrap(), b"new");
    assert!(!root.join("data/old").exists());
    assert!(!root.join("data/sub").exists());
    // Whiteout files are never part of the result.
    assert!(!root.join("etc/.wh.gone").exists());
    assert!(!root.join("data/.wh..wh..opq").exists());
}

#[test]
fn a_later_layer_replaces_a_directory_by_a_file_and_a_file_by_a_symlink() {
    let s = Scratch::new();
    let lower = layer(
        &s.0,
        "lower",
        &[E::Dir("x/"), E::File("x/inner", b"1"), E::File("y", b"2")],
    );
    let upper = layer(
        &s.0,
        "upper",
        &[E::File("x", b"now a file"), E::Symlink("y", "x")],
    );
    s.apply(&lower).unwrap();
    s.apply(&upper).unwrap();
    assert_eq!(fs::read(s.root().join("x")).unwrap(), b"now a file");
    assert_eq!(fs::read_link(s.root().join("y")).unwrap(), Path::new("x"));
}

#[test]
fn a_path_with_dot_dot_is_refused() {
    let s = Scratch::new();
    let evil = layer(&s.0, "evil", &[E::File("../escaped", b"x")]);
    assert_hostile(s.apply(&evil), "'..'");
    assert!(!s.0.join("escaped").exists());
    let evil = layer(&s.0, "evil2", &[E::File("etc/../../escaped", b"x")]);
    assert_hostile(s.apply(&evil), "'..'");
    assert!(!s.0.join("escaped").exists());
}

#[test]
fn an_absolute_path_lands_inside_the_root() {
    let s = Scratch::new();
    s.apply(&layer(&s.0, "abs", &[E::File("/inside", b"x")]))
        .unwrap();
    assert!(s.root().join("inside").is_file());
}

#[test]
fn a_symlink_that_leaves_the_root_is_followed_inside_it_never_on_the_host() {
    let s = Scratch::new();
    let outside = s.0.join("outside");
    fs::create_dir_all(&outside).unwrap();
    // The same layer plants an absolute symlink and then writes through it: the write lands
    // where the sandbox will see it, under the root.
    let abs = outside.to_str().unwrap();
    s.apply(&layer(
        &s.0,
        "abs",
        &[E::Symlink("link", abs), E::File("link/planted", b"x")],
    ))
    .unwrap();
    assert!(!outside.join("planted").exists());
    assert_eq!(
        fs::read(s.root().join(abs.trim_start_matches('/')).join("planted")).unwrap(),
        b"x"
    );
    // A relative one climbing out, planted by a lower layer: `..` stops at the root.
    s.apply(&layer(
        &s.0,
        "lower",
        &[E::Symlink("up", "../../../outside")],
    ))
    .unwrap();
    s.apply(&layer(&s.0, "upper", &[E::File("up/planted2", b"y")]))
        .unwrap();
    assert!(!outside.join("planted2").exists());
    assert_eq!(fs::read(s.root().join("outside/planted2")).unwrap(), b"y");
    // A loop is refused.
    s.apply(&layer(
        &s.0,
        "loop",
        &[E::Symlink("l1", "l2"), E::Symlink("l2", "l1")],
    ))
    .unwrap();
    assert_hostile(
        s.apply(&layer(&s.0, "through", &[E::File("l1/x", b"z")])),
        "loop",
    );
}

#[test]
fn a_whiteout_through_a_symlink_that_leaves_the_root_deletes_nothing_outside() {
    let s = Scratch::new();
    let outside = s.0.join("outside");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("precious"), b"keep me").unwrap();
    s.apply(&layer(
        &s.0,
        "lower",
        &[E::Symlink("etc", outside.to_str().unwrap())],
    ))
    .unwrap();
    s.apply(&layer(&s.0, "upper", &[E::File("etc/.wh.precious", b"")]))
        .unwrap();
    s.apply(&layer(&s.0, "opaque", &[E::File("etc/.wh..wh..opq", b"")]))
        .unwrap();
    assert_eq!(fs::read(outside.join("precious")).unwrap(), b"keep me");
    // The symlink itself is deleted by a whiteout of its own name, not what it points to.
    s.apply(&layer(&s.0, "gone", &[E::File(".wh.etc", b"")]))
        .unwrap();
    assert!(fs::symlink_metadata(s.root().join("etc")).is_err());
    assert_eq!(fs::read(outside.join("precious")).unwrap(), b"keep me");
}

#[test]
fn a_symlink_pointing_outside_is_kept_as_a_link_and_never_followed() {
    // Inside the sandbox an absolute link resolves against the sandbox's root: it is fine to
    // keep, as long as unpacking never writes through it.
    let s = Scratch::new();
    s.apply(&layer(&s.0, "l", &[E::Symlink("passwd", "/etc/passwd")]))
        .unwrap();
    assert_eq!(
        fs::read_link(s.root().join("passwd")).unwrap(),
        Path::new("/etc/passwd")
    );
    // Replacing it with a file replaces the link, not /etc/passwd.
    let before = fs::read("/etc/passwd").unwrap();
    s.apply(&layer(&s.0, "m", &[E::File("passwd", b"mine")]))
        .unwrap();
    assert_eq!(fs::read(s.root().join("passwd")).unwrap(), b"mine");
    assert_eq!(fs::read("/etc/passwd").unwrap(), before);
}

#[test]
fn a_hard_link_never_reaches_a_file_outside_the_root() {
    let s = Scratch::new();
    fs::write(s.0.join("secret"), b"host secret").unwrap();
    assert_hostile(
        s.apply(&layer(&s.0, "evil", &[E::HardLink("stolen", "../secret")])),
        "'..'",
    );
    // Through a symlink of the root: resolved inside the root, where there is no such file.
    symlink(s.0.to_str().unwrap(), s.root().join("host")).unwrap();
    let result = s.apply(&layer(
        &s.0,
        "evil2",
        &[E::HardLink("stolen", "host/secret")],
    ));
    assert!(result.is_err(), "{result:?}");
    assert!(!s.root().join("stolen").exists());
    // A hard link inside the root works.
    s.apply(&layer(
        &s.0,
        "ok",
        &[E::File("a", b"1"), E::HardLink("b", "a")],
    ))
    .unwrap();
    assert_eq!(fs::read(s.root().join("b")).unwrap(), b"1");
}

#[test]
fn a_device_node_is_refused() {
    let s = Scratch::new();
    assert_hostile(
        s.apply(&layer(&s.0, "dev", &[E::CharDevice("dev/mem")])),
        "device node",
    );
    assert!(fs::symlink_metadata(s.root().join("dev/mem"))
        .map(|m| !m.file_type().is_char_device())
        .unwrap_or(true));
}

#[test]
fn a_layer_past_the_unpacked_size_limit_is_refused() {
    let s = Scratch::new();
    let big = vec![0u8; 4096];
    let blob = layer(&s.0, "big", &[E::File("a", &big), E::File("b", &big)]);
    let tight = UnpackLimits {
        max_bytes: 6000,
        max_entries: 1000,
    };
    let result = apply_layer(
        &s.root(),
        &blob,
        Compression::None,
        &tight,
        &mut Unpacked::default(),
    );
    assert!(
        matches!(result, Err(ImageError::TooLarge { .. })),
        "{result:?}"
    );
    let few = UnpackLimits {
        max_bytes: 1 << 20,
        max_entries: 1,
    };
    let result = apply_layer(
        &s.root(),
        &blob,
        Compression::None,
        &few,
        &mut Unpacked::default(),
    );
    assert!(
        matches!(result, Err(ImageError::TooLarge { .. })),
        "{result:?}"
    );
}

#[test]
fn a_gzip_bomb_stops_at_the_limit_without_writing_it_out() {
    let s = Scratch::new();
    // 64 MiB of zeros compress to about 64 KiB.
    let zeros = vec![0u8; 64 << 20];
    let plain = layer(&s.0, "plain", &[E::File("bomb", &zeros)]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, &fs::read(&plain).unwrap()).unwrap();
    let blob = s.0.join("bomb.gz");
    fs::write(&blob, gz.finish().unwrap()).unwrap();
    assert!(fs::metadata(&blob).unwrap().len() < 1 << 20);
    let result = apply_layer(
        &s.root(),
        &blob,
        Compression::Gzip,
        &ROOMY,
        &mut Unpacked::default(),
    );
    assert!(
        matches!(result, Err(ImageError::TooLarge { .. })),
        "{result:?}"
    );
    assert!(!s.root().join("bomb").exists());
}

#[test]
fn media_types_map_to_compressions_and_zstd_is_refused() {
    assert_eq!(
        Compression::of("application/vnd.oci.image.layer.v1.tar+gzip").unwrap(),
        Compression::Gzip
    );
    assert_eq!(
        Compression::of("application/vnd.docker.image.rootfs.diff.tar.gzip").unwrap(),
        Compression::Gzip
    );
    assert_eq!(
        Compression::of("application/vnd.oci.image.layer.v1.tar").unwrap(),
        Compression::None
    );
    assert!(Compression::of("application/vnd.oci.image.layer.v1.tar+zstd").is_err());
}
