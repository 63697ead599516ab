//! Builds the statx shim (`shim/statx_shim.c`) that gVisor sandboxes preload: a tiny shared
//! object with no libc of its own, embedded in hostd and written into every agent bundle (see
//! `src/bundle.rs`, `GUEST_PRELOAD_FILE`). Needs the host's C compiler (`$CC`, else `cc`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "shim/statx_shim.c";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=CC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("berth-statx.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-nostdlib",
            "-Wall",
            "-Werror",
            "-o",
        ])
        .arg(&out)
        .arg(source)
        .status()
        .unwrap_or_else(|e| panic!("run {cc} to build {source} (install a C compiler): {e}"));
    assert!(status.success(), "{cc} failed to build {source}");
}
