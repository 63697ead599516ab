//! What a user may read of a host-side failure: [`HostdError::public_reason`] and
//! [`HostdError::result_reason`].
//!
//! A snapshot's `reason` and a sandbox's `state_reason` reach the API. The full
//! [`HostdError::report`] names host file-system paths (the state dir, a sandbox's upper dir,
//! the local object store's directory), command lines and console output; those stay in
//! hostd's log. The public reason says what kind of thing failed, in words the user can act on;
//! the result reason (a failed create, start or stop) says what failed in the error's own words
//! with every host path taken out.

use berth_storage::StorageError;

use super::HostdError;

/// The public reason of any failure this module does not name: details only in the log.
pub const HOST_FAILURE: &str = "the host failed (the details are in its log)";

impl HostdError {
    /// What a user may read of this error: its kind, never a host path, a command line or a
    /// console (log [`HostdError::report`] beside it). An error of a kind not named here reads
    /// as [`HOST_FAILURE`].
    pub fn public_reason(&self) -> String {
        match self {
            HostdError::Storage(e) => storage_reason(e),
            HostdError::UnknownSandbox { .. } => "the sandbox is not running on its host".into(),
            HostdError::ShuttingDown => "its host is shutting down".into(),
            HostdError::UnsupportedRuntime { name, .. } => {
                format!("runtime {name:?} is not offered by its host")
            }
            HostdError::SnapshotUnsupported { .. } => self.to_string(),
            HostdError::AgentTimeout { .. } | HostdError::Agent { .. } => {
                "the sandbox's agent did not answer".into()
            }
            HostdError::ContainerExited { .. } => "the sandbox exited while booting".into(),
            _ => HOST_FAILURE.into(),
        }
    }
}

/// What stands for a host path taken out of a result reason.
pub const HOST_PATH: &str = "<host path>";

impl HostdError {
    /// What a failed create, start or stop reports (the sandbox's `state_reason`, shown by the
    /// API): what failed, with the error's own detail where it names no host path — a mount's
    /// error number, a tool's name, exit status and (paths out) stderr, an I/O step and its OS
    /// error — and every absolute host path replaced by [`HOST_PATH`]. Log
    /// [`HostdError::report`] beside it: that keeps the paths and command lines.
    ///
    /// What is the sandbox's own is kept whole: a template or runtime asked for, the console of
    /// a container that exited while booting, an agent's answer, a path inside the sandbox.
    pub fn result_reason(&self) -> String {
        match self {
            HostdError::Mount {
                operation, source, ..
            } => format!("{operation} of a sandbox file system failed: {source}"),
            HostdError::Io { context, source } => {
                format!("{}: {}", without_host_paths(context), io_words(source))
            }
            HostdError::Tool {
                program,
                status,
                stderr,
                ..
            } => {
                let program = std::path::Path::new(program)
                    .file_name()
                    .map_or_else(|| program.clone(), |n| n.to_string_lossy().into_owned());
                match without_host_paths(stderr.trim()) {
                    said if said.is_empty() => format!("{program} failed ({status})"),
                    said => format!("{program} failed ({status}): {said}"),
                }
            }
            HostdError::StateFile { .. } => "a state file of the sandbox on its host is invalid \
                (the details are in the host's log)"
                .into(),
            HostdError::StateDirNotSearchable { .. }
            | HostdError::HostIdFile { .. }
            | HostdError::HostIdMismatch { .. } => HOST_FAILURE.into(),
            HostdError::Image(crate::image::ImageError::Io { context, source }) => format!(
                "template image: {}: {}",
                without_host_paths(context),
                io_words(source)
            ),
            // A reference, a registry's answer, a path inside the image: the request's own.
            HostdError::Image(_) => self.to_string(),
            HostdError::Storage(_) => self.public_reason(),
            HostdError::UnknownTemplate { .. }
            | HostdError::UnsupportedRuntime { .. }
            | HostdError::SnapshotUnsupported { .. }
            | HostdError::ContainerExited { .. }
            | HostdError::File { .. }
            | HostdError::UnknownSandbox { .. }
            | HostdError::ShuttingDown => self.to_string(),
            _ => without_host_paths(&self.report()),
        }
    }
}

/// An OS error's own words ("No such file or directory (os error 2)"); an error made with a
/// message of its own only by its kind, as that message may name a path.
fn io_words(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(_) => e.to_string(),
        None => e.kind().to_string(),
    }
}

/// `text` with every absolute path in it (a `/` that starts a word, or follows `=`, a quote or
/// a bracket, up to the next space, quote or bracket, less a trailing `:`, `,` or `.`) replaced
/// by [`HOST_PATH`].
pub(crate) fn without_host_paths(text: &str) -> String {
    const STARTS: [char; 6] = ['=', '"', '\'', '(', '[', '<'];
    const ENDS: [char; 7] = ['"', '\'', ')', ']', '>', ';', '\n'];
    let mut out = String::with_capacity(text.len());
    // `text[copied..]` is what is not in `out` yet; `from` is where to look for a `/`.
    let (mut copied, mut from) = (0, 0);
    while let Some(found) = text[from..].find('/') {
        let at = from + found;
        let starts_word = text[..at]
            .chars()
            .next_back()
            .is_none_or(|c| c.is_whitespace() || STARTS.contains(&c));
        if !starts_word {
            from = at + 1;
            continue;
        }
        let path = &text[at..];
        let len = path
            .find(|c: char| c.is_whitespace() || ENDS.contains(&c))
            .unwrap_or(path.len());
        let kept = path[..len].trim_end_matches([':', ',', '.']).len().max(1);
        out.push_str(&text[copied..at]);
        out.push_str(HOST_PATH);
        copied = at + kept;
        from = copied;
    }
    out.push_str(&text[copied..]);
    out
}

fn storage_reason(e: &StorageError) -> String {
    match e {
        StorageError::Store { op, .. } => format!(
            "the object store failed a {op} (it refused the request, was unreachable or timed \
             out)"
        ),
        StorageError::Config { .. } => "the host's object store setting is invalid".into(),
        StorageError::Corrupt { hash, .. } => {
            format!("chunk {hash} is corrupt or missing in the object store")
        }
        StorageError::BadManifest { snapshot, .. } => {
            format!("the manifest of snapshot {snapshot} is invalid")
        }
        StorageError::NotFound(_) | StorageError::NoSuchTree { .. } => e.to_string(),
        StorageError::Unsupported { reason, .. } => {
            format!("the sandbox's disk holds what a snapshot cannot carry ({reason})")
        }
        StorageError::Io { action, .. } => {
            format!("the host could not {action} a file of the snapshot (details in its log)")
        }
        StorageError::Task(_) => HOST_FAILURE.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const HOST_DIR: &str = "/var/lib/berth/sandboxes/0190-secret/upper";

    #[test]
    fn no_public_reason_names_a_host_path_and_the_store_is_named() {
        let local_store = object_store::Error::Generic {
            store: "LocalFileSystem",
            source: format!("Unable to open file {HOST_DIR}/objects/chunks/ab#1: Not a directory")
                .into(),
        };
        let errors = [
            HostdError::Storage(StorageError::Store {
                op: berth_storage::StoreOp::Put,
                key: "chunks/ab/ab12.zst".into(),
                source: local_store,
            }),
            HostdError::Storage(StorageError::Io {
                action: "read",
                path: PathBuf::from(HOST_DIR).join("etc/passwd"),
                source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            }),
            HostdError::Storage(StorageError::Unsupported {
                path: PathBuf::from(HOST_DIR).join("dev/sda"),
                reason: "a device".into(),
            }),
            HostdError::Io {
                context: format!("create {HOST_DIR}"),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
            HostdError::Tool {
                program: "runc".into(),
                args: format!("--root {HOST_DIR} pause x"),
                status: "exit status: 1".into(),
                stderr: format!("{HOST_DIR}: no such file"),
            },
        ];
        for e in &errors {
            assert!(
                e.report().contains(HOST_DIR),
                "the log keeps it: {}",
                e.report()
            );
            let public = e.public_reason();
            assert!(!public.contains("/var"), "{public}");
            assert!(!public.contains(HOST_DIR), "{public}");
        }
        assert!(errors[0].public_reason().contains("object store"));
        assert!(errors[2].public_reason().contains("a device"));
        assert_eq!(errors[4].public_reason(), HOST_FAILURE);
    }

    /// Found by an attack run: a failed create's `state_reason` carried hostd's whole report,
    /// the mount point, the runtime's command line and the state dir with it.
    #[test]
    fn a_result_reason_says_what_failed_without_a_host_path_and_the_log_keeps_them() {
        let cases = [
            (
                HostdError::Mount {
                    operation: "mount",
                    path: PathBuf::from(HOST_DIR).join("rootfs"),
                    source: nix::Error::EPERM,
                },
                "mount of a sandbox file system failed: EPERM: Operation not permitted",
            ),
            (
                HostdError::Io {
                    context: format!("create {HOST_DIR}/console.log"),
                    source: std::io::Error::from_raw_os_error(28),
                },
                "create <host path>: No space left on device (os error 28)",
            ),
            (
                HostdError::Io {
                    context: format!("spawn {HOST_DIR}/runc state"),
                    source: std::io::Error::other(format!("{HOST_DIR} is gone")),
                },
                "spawn <host path> state: other error",
            ),
            (
                HostdError::Tool {
                    program: "/usr/local/bin/runc".into(),
                    args: format!("--root {HOST_DIR} run --bundle {HOST_DIR}/bundle x"),
                    status: "exit status: 1".into(),
                    stderr: format!(
                        "error mounting \"{HOST_DIR}/disk.img\" to rootfs at \"/data\": \
                         open {HOST_DIR}/x: permission denied\n"
                    ),
                },
                "runc failed (exit status: 1): error mounting \"<host path>\" to rootfs at \
                 \"<host path>\": open <host path>: permission denied",
            ),
            (
                HostdError::StateFile {
                    path: PathBuf::from(HOST_DIR).join("record.json"),
                    source: serde_json::from_str::<u8>("x").unwrap_err(),
                },
                "a state file of the sandbox on its host is invalid (the details are in the \
                 host's log)",
            ),
            (
                HostdError::Cleanup {
                    errors: vec![format!("unmount: umount {HOST_DIR}/rootfs: EBUSY")],
                },
                "cleanup failed: unmount: umount <host path>: EBUSY",
            ),
        ];
        for (error, want) in &cases {
            assert!(
                error.report().contains(HOST_DIR),
                "the log keeps the path: {}",
                error.report()
            );
            let reason = error.result_reason();
            assert_eq!(&reason, want);
            assert!(!reason.contains("/var"), "{reason}");
        }
        // What is the request's or the sandbox's own stays whole.
        let template = HostdError::UnknownTemplate {
            name: "ghost".into(),
            known: "base".into(),
        };
        assert_eq!(template.result_reason(), template.to_string());
        let exited = HostdError::ContainerExited {
            container_id: "c".into(),
            console_tail: "sh: /bin/app: not found".into(),
        };
        assert_eq!(exited.result_reason(), exited.to_string());
    }

    #[test]
    fn only_absolute_paths_are_taken_out() {
        for (text, want) in [
            (
                "pull docker.io/library/alpine:3 failed",
                "pull docker.io/library/alpine:3 failed",
            ),
            (
                "GET https://registry.invalid/v2/ refused",
                "GET https://registry.invalid/v2/ refused",
            ),
            (
                "address pool 10.200.0.0/16 is exhausted",
                "address pool 10.200.0.0/16 is exhausted",
            ),
            ("--root=/run/runc (x)", "--root=<host path> (x)"),
            ("at /a/b, then /c.", "at <host path>, then <host path>."),
            ("(/a/b)", "(<host path>)"),
            ("/", "<host path>"),
        ] {
            assert_eq!(without_host_paths(text), want, "{text}");
        }
    }
}
