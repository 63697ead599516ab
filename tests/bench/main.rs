//! `berth bench` against a test stack (or, `--failover`, on a private stack of its own): a mode
//! runs to its end and prints every row of its table (the figures themselves are recorded in
//! `RESULTS.md`, never asserted: they depend on the machine).

#[path = "../support/mod.rs"]
mod support;

mod failover;
mod floors;
mod interrupt;
mod storage;

/// Checks the table `berth bench` printed on `stdout` against `expected` (each row's name
/// prefix, and whether it has a floor), every row with one sample: `| name | n | p50 | p90 |
/// floor | floor n | floor p50 | ratio |`, n 1, a positive p50, no p90 below 10 samples; a
/// floored row one floor sample, a positive floor p50 and a ratio; the others neither. Returns
/// the floor names of the floored rows, in order.
pub(crate) fn assert_one_sample_table<'a>(
    stdout: &'a str,
    expected: &[(&str, bool)],
) -> Vec<&'a str> {
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| operation"))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), expected.len(), "{stdout}");
    let mut floors = Vec::new();
    for ((name, floored), row) in expected.iter().zip(&rows) {
        assert_eq!(row.len(), 8, "{row:?}");
        assert!(row[0].starts_with(name), "{row:?} is not {name}");
        assert_eq!(row[1], "1", "one sample: {row:?}");
        assert!(row[2].parse::<f64>().unwrap() > 0.0, "p50: {row:?}");
        assert_eq!(row[3], "—", "no p90 below 10 samples: {row:?}");
        if *floored {
            assert_eq!(row[5], "1", "one floor sample: {row:?}");
            assert!(row[6].parse::<f64>().unwrap() > 0.0, "floor p50: {row:?}");
            assert!(row[7].ends_with('x'), "ratio: {row:?}");
            floors.push(row[4]);
        } else {
            assert_eq!((row[4], row[7]), ("—", "n/a"), "{row:?}");
        }
    }
    floors
}

/// Sends `child` (a `berth bench`) SIGINT, as a terminal's Ctrl-C does, and waits at most
/// `patience` for it to exit; asserts it exited 130 with the one-line message as its last and
/// no backtrace (the caller sets `RUST_BACKTRACE=1`). Returns its stderr.
pub(crate) async fn interrupt(
    child: tokio::process::Child,
    patience: std::time::Duration,
) -> String {
    use nix::sys::signal::{kill, Signal};
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    kill(pid, Signal::SIGINT).unwrap();
    let out = tokio::time::timeout(patience, child.wait_with_output())
        .await
        .expect("the bench exits after SIGINT")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert_eq!(
        stderr.lines().last(),
        Some("berth bench: interrupted (SIGINT or SIGTERM)"),
        "{stderr}"
    );
    assert!(!stderr.contains("backtrace"), "{stderr}");
    stderr
}
