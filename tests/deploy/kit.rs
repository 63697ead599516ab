//! Paths and tools the deployment tests share.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `berth` binary under test.
pub fn berth() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_berth"))
}

/// `berth docs config`, run through the built binary.
pub fn rendered_reference() -> String {
    let out = run(Command::new(berth()).args(["docs", "config"]));
    assert!(
        out.status.success(),
        "berth docs config: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The venv with the pinned validator (`.ci/run` makes it).
pub fn venv() -> PathBuf {
    std::env::var_os("BERTH_DEPLOY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/berth-deploy-venv"))
}

/// A tool of the venv, or a failure that says how to get it.
pub fn venv_tool(name: &str) -> PathBuf {
    let path = venv().join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run .ci/run, or python3 -m venv {v} && {v}/bin/pip install \
         'kubernetes-validate==1.37.0' (BERTH_DEPLOY_VENV names another venv)",
        path.display(),
        v = venv().display()
    );
    path
}

/// Runs `cmd`, failing the test when it cannot start.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("run {:?}: {e}", cmd.get_program()))
}

/// Lossy UTF-8.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The files in `dir` whose names end in `suffix`, sorted.
pub fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no *{suffix} in {}", dir.display());
    out
}

/// Every environment variable the reference names: backquoted upper-case words, and the
/// comma-separated names of its "outside the flags" rows.
pub fn documented_variables(reference: &str) -> BTreeSet<String> {
    reference
        .split('`')
        .skip(1)
        .step_by(2)
        .flat_map(|quoted| quoted.split(", "))
        .map(|w| w.trim_end_matches(", …").trim().to_owned())
        .filter(|w| is_variable(w))
        .collect()
}

/// `NAME_LIKE_THIS`.
pub fn is_variable(word: &str) -> bool {
    word.len() > 2
        && word
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && word.starts_with(|c: char| c.is_ascii_uppercase())
}

/// Every `--flag` the reference names.
pub fn documented_flags(reference: &str) -> BTreeSet<String> {
    reference
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.strip_prefix("--")
                .is_some_and(|f| f.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        })
        .map(str::to_owned)
        .collect()
}
