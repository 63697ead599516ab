//! Everyday shell tools inside gVisor sandboxes of every template: `ls -l`, `stat`, `cp -a`,
//! `find`, `tar` (and `pip` where there is Python). gVisor release 20221219 refuses the
//! `AT_NO_AUTOMOUNT` flag that coreutils 9 passes to `statx`, which made `ls -l` and `stat`
//! fail with "Invalid argument" on every path of the `python` template; hostd preloads a shim
//! that drops the flag (`hostd/shim/statx_shim.c`).

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::Stack;

/// Each tool, as a shell line that fails unless the tool did its work.
const TOOLS: &[(&str, &str)] = &[
    ("ls -l", "ls -l / >/dev/null && ls -l /etc/passwd"),
    ("stat", "stat /etc/passwd && stat -c '%s' /etc/passwd"),
    (
        "cp -a",
        "cp -a /etc /tmp/etc-copy && test -f /tmp/etc-copy/passwd",
    ),
    ("find", "find /etc -name passwd | grep -q /etc/passwd"),
    (
        "tar",
        "tar cf /tmp/etc.tar /etc 2>/dev/null && tar tf /tmp/etc.tar | grep -q passwd",
    ),
];

/// Runs every tool of [`TOOLS`] (and `extra`) in a new sandbox of `template`; returns the
/// failures, each with its output.
async fn failing_tools(stack: &Stack, template: &str, extra: &[(&str, &str)]) -> Vec<String> {
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": template, "vcpus": 1, "memory_mib": 512})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let mut failures = Vec::new();
    for (tool, line) in TOOLS.iter().chain(extra) {
        let (status, out) = stack.exec(&id, &["sh", "-c", line]).await;
        if status != 200 || out["exit_code"] != 0 {
            failures.push(format!("{template}: {tool}: {out}"));
        }
    }
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.nothing_left(&id).await;
    failures
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn everyday_tools_work_in_gvisor_sandboxes_of_every_template(db: PgPool) {
    // Built once per machine (debootstrap from apt's mirror); a no-op when cached.
    let cache = std::path::Path::new(berth_hostd::template::DEFAULT_TEMPLATE_CACHE);
    berth_hostd::template::build_cached("python", cache)
        .await
        .expect("build the python template");
    let stack = Stack::start(db, 1).await;
    let pip = [
        ("pip", "pip --version && python3 -m pip list >/dev/null"),
        (
            "python os.stat",
            "python3 -c 'import os; os.stat(\"/etc/passwd\")'",
        ),
    ];
    let mut failures = failing_tools(&stack, "python", &pip).await;
    failures.extend(failing_tools(&stack, "base-gvisor", &[]).await);
    assert!(failures.is_empty(), "{failures:#?}");
    stack.teardown().await;
}
