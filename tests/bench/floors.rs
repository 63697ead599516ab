//! The real-runtime bench's runtime floors: raw `runc run` and, where crun is installed, raw
//! `crun run` of the same bundle, printed with the mode crun ran in or what it refused with
//! (issue 16 lever 5). The figures are recorded in `RESULTS.md`, never asserted here.

use std::process::Stdio;

use sqlx::PgPool;

use crate::support::Stack;

/// Whether `crun` is on `PATH`.
fn crun_installed() -> bool {
    std::process::Command::new("crun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_bench_prints_the_crun_floor_in_the_mode_it_ran_or_what_crun_refused(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["bench", "--sandboxes", "1", "--burst", "1"])
        .args(["--gvisor-template", "", "--podman-pairs", "0"])
        .args(["--runsc-floor-samples", "0"])
        .args(["--api", &stack.base, "--key", &stack.key])
        .arg("--state-dir")
        .arg(&stack.root)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    let runc = stdout
        .lines()
        .find(|l| l.starts_with("| raw runc run (busybox true) |"));
    assert!(runc.is_some_and(|l| l.contains("| 20 |")), "{stdout}");
    let crun: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| raw crun run (busybox true"))
        .collect();
    // The figures, for `--nocapture`.
    eprintln!("{}\n{}", runc.unwrap_or_default(), crun.join("\n"));
    if !crun_installed() {
        assert_eq!(crun, Vec::<&str>::new(), "no crun, no row");
    } else {
        assert_eq!(crun.len(), 1, "{stdout}");
        let row = crun[0];
        let ran =
            row.starts_with("| raw crun run (busybox true; cgroupfs, ") && row.contains("| 20 |");
        let refused =
            row.starts_with("| raw crun run (busybox true): refused: ") && row.contains("| 0 |");
        assert!(ran || refused, "{row}");
    }
    stack.teardown().await;
}
