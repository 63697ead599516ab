//! The state file readers against trimmed files runc 1.1.5 and runsc 20221219 wrote on the
//! test machine (`config`, `namespace_paths` and `spec` cut short), and fake roots.

use std::path::{Path, PathBuf};

use super::runc::{self, RuncState};
use super::runsc::{self, SandboxProcess};
use super::*;
use crate::runtime::ContainerStatus;

/// A `runc create`d container's `state.json` (cgroup v1 with the hybrid unified hierarchy).
const RUNC_CREATED: &str = r#"{"id": "c-created", "init_process_pid": 12028, "init_process_start": 117772, "created": "2026-12-06T20:31:35.334696874Z", "config": {"rootfs": "/var/tmp/sf-probe.dCbH/bundle/rootfs", "hostname": "runc", "version": "1.0.2-dev", "labels": ["bundle=/var/tmp/sf-probe.dCbH/bundle"]}, "rootless": false, "cgroup_paths": {"": "/sys/fs/cgroup/unified/c-created", "blkio": "/sys/fs/cgroup/blkio/c-created", "cpu": "/sys/fs/cgroup/cpu/c-created", "cpuacct": "/sys/fs/cgroup/cpuacct/c-created", "cpuset": "/sys/fs/cgroup/cpuset/c-created", "devices": "/sys/fs/cgroup/devices/c-created", "freezer": "/sys/fs/cgroup/freezer/c-created", "memory": "/sys/fs/cgroup/memory/process_api/69e540df8e44b5a11cc1aea49fe0f6d7/c-created", "name=systemd": "/sys/fs/cgroup/systemd/c-created", "pids": "/sys/fs/cgroup/pids/c-created"}, "namespace_paths": {"NEWCGROUP": "/proc/12028/ns/cgroup", "NEWIPC": "/proc/12028/ns/ipc"}, "external_descriptors": ["/dev/null", "/dev/null", "/dev/null"], "intel_rdt_path": ""}"#;

/// A `runsc create`d container's state file (`s-created_sandbox:s-created.state`).
const RUNSC_CREATED: &str = r#"{"id": "s-created", "spec": {"ociVersion": "1.0.2-dev", "root": {"path": "/var/tmp/sf-probe.dCbH/bundle/rootfs", "readonly": true}, "hostname": "runc"}, "bundleDir": "/var/tmp/sf-probe.dCbH/bundle", "createdAt": "2026-12-06T20:31:46.699329414Z", "owner": "", "consoleSocket": "", "status": "created", "goferPid": 13899, "sandbox": {"id": "s-created", "pid": 13903, "uid": 65534, "gid": 65534, "cgroup": {"cgroupv1": {"name": "/s-created", "parents": null, "own": {"blkio": true, "cpu": true, "cpuacct": true, "cpuset": true, "devices": true, "freezer": true, "memory": true, "pids": true, "systemd": true}}}, "originalOomScoreAdj": 0}, "compatCgroup": {"cgroupunknown": null}, "saver": {"rootDir": "/var/tmp/sf-probe.dCbH/runsc", "id": {"sandboxId": "s-created", "containerId": "s-created"}}}"#;

/// The `/proc/<pid>/stat` of that runc container's init (`sleep`), started at tick 117774.
const SLEEP_STAT: &str = "12043 (sleep) S 1 12043 12043 0 -1 4194560 720 0 0 0 0 0 0 0 20 0 1 0 117774 2322432 332 18446744073709551615 4198400 5785993 140734937964896 0 0 0 0 0 0 1 0 0 17 1 0 0 0 0 0 6141704 6178576 327884800 140734937968521 140734937968537 140734937968537 140734937968621 0";

fn temp_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("berth-{name}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&root).unwrap();
    root
}

fn proc_stat(state: char, start_time: u64) -> Option<ProcStat> {
    Some(ProcStat { state, start_time })
}

#[test]
fn a_proc_stat_line_gives_the_state_and_the_start_time_in_field_22() {
    assert_eq!(parse_proc_stat(SLEEP_STAT), proc_stat('S', 117774));
    let odd_name = SLEEP_STAT.replace("(sleep)", "(a) b (c)");
    assert_eq!(
        parse_proc_stat(&odd_name),
        proc_stat('S', 117774),
        "the name may hold spaces and parentheses"
    );
    assert_eq!(parse_proc_stat("12043 (sleep) S 1 2 3"), None, "cut short");
    assert_eq!(parse_proc_stat(""), None);
}

#[test]
fn the_current_process_reads_as_alive_and_pid_zero_as_gone() {
    let own = read_proc_stat(i64::from(std::process::id()))
        .unwrap()
        .unwrap();
    assert!(!own.exited());
    assert!(own.start_time > 0);
    assert_eq!(read_proc_stat(0).unwrap(), None);
    assert_eq!(read_proc_stat(-1).unwrap(), None);
}

#[test]
fn a_captured_runc_state_parses_to_its_init_and_cgroups() {
    let state = runc::parse(Path::new("state.json"), RUNC_CREATED.as_bytes()).unwrap();
    assert_eq!(state.init_process_pid, 12028);
    assert_eq!(state.init_process_start, 117772);
    assert_eq!(
        state.cgroup_paths.get("freezer").map(String::as_str),
        Some("/sys/fs/cgroup/freezer/c-created")
    );
    let torn = &RUNC_CREATED[..RUNC_CREATED.len() / 2];
    assert!(matches!(
        runc::parse(Path::new("state.json"), torn.as_bytes()),
        Err(StateFileError::Parse { .. })
    ));
}

fn runc_state(start: u64) -> RuncState {
    RuncState {
        init_process_pid: 42,
        init_process_start: start,
        cgroup_paths: Default::default(),
    }
}

#[test]
fn a_runc_init_that_runs_since_its_recorded_start_is_running_or_created_before_start() {
    let state = runc_state(117774);
    let init = proc_stat('S', 117774);
    assert_eq!(
        runc::status(&state, false, init, false),
        ContainerStatus::Running
    );
    assert_eq!(
        runc::status(&state, false, init, true),
        ContainerStatus::Created,
        "exec.fifo is there until runc start"
    );
}

#[test]
fn a_runc_pid_now_naming_a_process_started_at_another_time_is_stopped() {
    let state = runc_state(117774);
    assert_eq!(
        runc::status(&state, false, proc_stat('S', 999_999), false),
        ContainerStatus::Stopped,
        "the pid was reused"
    );
    assert_eq!(
        runc::status(&state, false, proc_stat('S', 999_999), true),
        ContainerStatus::Stopped,
        "also before start"
    );
}

#[test]
fn a_runc_init_that_is_gone_or_a_zombie_is_stopped_and_a_frozen_cgroup_is_paused_first() {
    let state = runc_state(117774);
    assert_eq!(
        runc::status(&state, false, None, false),
        ContainerStatus::Stopped
    );
    for exited in ['Z', 'X', 'x'] {
        assert_eq!(
            runc::status(&state, false, proc_stat(exited, 117774), false),
            ContainerStatus::Stopped
        );
    }
    assert_eq!(
        runc::status(&state, true, proc_stat('S', 117774), false),
        ContainerStatus::Paused
    );
    assert_eq!(
        runc::status(&state, true, None, false),
        ContainerStatus::Paused,
        "runc looks at the freezer before the init"
    );
}

#[test]
fn freezer_files_say_frozen_only_for_states_runc_calls_frozen() {
    let (s, f) = (
        Path::new("freezer.state"),
        Path::new("freezer.self_freezing"),
    );
    assert!(!runc::v1_freezer_values(s, b"THAWED\n", f, None).unwrap());
    assert!(runc::v1_freezer_values(s, b"FROZEN\n", f, Some(b"1\n")).unwrap());
    assert!(
        runc::v1_freezer_values(s, b"FROZEN\n", f, None).unwrap(),
        "a kernel without self_freezing"
    );
    assert!(
        !runc::v1_freezer_values(s, b"FROZEN\n", f, Some(b"0\n")).unwrap(),
        "frozen only through an ancestor"
    );
    assert!(matches!(
        runc::v1_freezer_values(s, b"FREEZING\n", f, None),
        Err(StateFileError::Unexpected { .. })
    ));
    let v2 = Path::new("cgroup.freeze");
    assert!(!runc::v2_freeze_value(v2, b"0\n").unwrap());
    assert!(runc::v2_freeze_value(v2, b"1\n").unwrap());
    assert!(runc::v2_freeze_value(v2, b"2\n").is_err());
}

#[test]
fn a_runc_root_lists_directories_with_a_state_file_and_fails_on_one_it_cannot_parse() {
    let root = temp_root("runc-root");
    // The test's own process as the init, started when /proc says.
    let me = read_proc_stat(i64::from(std::process::id()))
        .unwrap()
        .unwrap();
    let state = |start: u64| {
        format!(
            r#"{{"id":"x","init_process_pid":{},"init_process_start":{start},"cgroup_paths":{{}}}}"#,
            std::process::id()
        )
    };
    for (id, start) in [("live", me.start_time), ("reused", me.start_time + 1)] {
        std::fs::create_dir(root.join(id)).unwrap();
        std::fs::write(root.join(id).join(runc::STATE_FILE), state(start)).unwrap();
    }
    std::fs::create_dir(root.join("being-created")).unwrap();
    std::fs::write(root.join("not-a-dir"), "{}").unwrap();
    let listed = runc::list(&root).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed["live"], ContainerStatus::Running);
    assert_eq!(listed["reused"], ContainerStatus::Stopped);

    std::fs::write(root.join("live").join(runc::STATE_FILE), "{\"init_pro").unwrap();
    let err = runc::list(&root).unwrap_err();
    assert_eq!(err.reason(), "parse", "{err}");
    std::fs::remove_dir_all(&root).unwrap();
    assert!(
        runc::list(&root).unwrap().is_empty(),
        "a root not made yet holds nothing"
    );
}

#[test]
fn runsc_state_file_names_split_into_container_and_sandbox() {
    assert_eq!(
        runsc::parse_file_name("c1_sandbox:s1.state"),
        Some(("c1", "s1"))
    );
    assert_eq!(runsc::parse_file_name("c1_sandbox:s1.lock"), None);
    assert_eq!(runsc::parse_file_name("c1.state"), None);
    assert_eq!(runsc::parse_file_name("_sandbox:s1.state"), None, "no id");
    assert_eq!(runsc::parse_file_name("c/1_sandbox:s1.state"), None);
}

#[test]
fn a_captured_runsc_state_parses_to_its_status_and_sandbox_pid() {
    let path = Path::new("s-created_sandbox:s-created.state");
    let state = runsc::parse(path, RUNSC_CREATED.as_bytes()).unwrap();
    assert_eq!(state.status, "created");
    assert_eq!(state.sandbox.map(|s| s.pid), Some(13903));
    assert_eq!(
        runsc::recorded_status(path, "paused").unwrap(),
        ContainerStatus::Paused
    );
    assert!(matches!(
        runsc::recorded_status(path, "restoring"),
        Err(StateFileError::Unexpected { .. })
    ));
    let stopped = r#"{"status":"stopped","sandbox":null}"#;
    assert_eq!(
        runsc::parse(path, stopped.as_bytes()).unwrap().sandbox,
        None
    );
}

#[test]
fn runsc_checks_only_created_and_running_against_the_sandbox_process() {
    use ContainerStatus::*;
    use SandboxProcess::*;
    // `kill(pid, 0)` for created: any process with the pid, a zombie too.
    assert_eq!(runsc::status(Created, Gone), Stopped);
    assert_eq!(runsc::status(Created, Exited), Created);
    assert_eq!(runsc::status(Created, Other), Created);
    // Signal 0 through the sandbox for running: only its own live sandbox answers.
    assert_eq!(runsc::status(Running, Own), Running);
    assert_eq!(runsc::status(Running, Other), Stopped, "the pid was reused");
    assert_eq!(runsc::status(Running, Exited), Stopped);
    assert_eq!(runsc::status(Running, Gone), Stopped);
    for recorded in [Creating, Paused, Stopped] {
        assert_eq!(runsc::status(recorded, Gone), recorded);
    }
}

#[test]
fn a_runsc_root_lists_state_files_and_fails_on_an_unknown_status() {
    let root = temp_root("runsc-root");
    let file = |id: &str| root.join(format!("{id}_sandbox:{id}.state"));
    // This test process is no runsc-sandbox: a running container with its pid is stopped.
    let me = std::process::id();
    std::fs::write(
        file("reused"),
        format!(r#"{{"status":"running","sandbox":{{"pid":{me}}}}}"#),
    )
    .unwrap();
    std::fs::write(file("paused"), r#"{"status":"paused","sandbox":{"pid":0}}"#).unwrap();
    std::fs::write(root.join("paused_sandbox:paused.lock"), "").unwrap();
    let listed = runsc::list(&root).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed["reused"], ContainerStatus::Stopped);
    assert_eq!(listed["paused"], ContainerStatus::Paused);

    std::fs::write(file("paused"), r#"{"status":"hibernating"}"#).unwrap();
    assert_eq!(runsc::list(&root).unwrap_err().reason(), "unexpected");
    std::fs::write(file("paused"), "").unwrap();
    assert_eq!(
        runsc::list(&root).unwrap_err().reason(),
        "parse",
        "a file runsc is rewriting"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn ids_are_those_the_runtimes_accept() {
    assert!(valid_id("0193a7c2-5b1e-7d4f-9a3b-123456789abc"));
    assert!(valid_id("a_b+c,d.e"));
    assert!(!valid_id(""));
    assert!(!valid_id("."));
    assert!(!valid_id(".."));
    assert!(!valid_id("a b"));
    assert!(!valid_id("a:b"));
}
