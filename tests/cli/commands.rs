//! Every subcommand of the user's CLI against a real stack with one runc host: templates,
//! create (waiting under its spinner), ls and get as tables and JSON, exec streaming live with
//! the command's exit code, cp in both directions, events, a preview token, stop, start and rm,
//! `berth login`'s config file, and shell completions.

use std::process::Stdio;

use serde_json::Value;
use sqlx::PgPool;
use tokio::io::AsyncReadExt;

use crate::kit::{mode_of, ok, User};
use crate::support::{Stack, SETTLE_TIMEOUT};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_cli_creates_lists_execs_copies_stops_starts_and_deletes_a_sandbox(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);

    // Templates, as a table and as JSON.
    let table = ok(&user, &["template", "ls"]).await;
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("base ")), "{table}");
    let templates: Value =
        serde_json::from_str(&ok(&user, &["template", "ls", "--json"]).await).expect("JSON");
    assert!(templates
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "base"));

    // Create waits until the sandbox runs and prints its id alone.
    let out = ok(
        &user,
        &[
            "sandbox",
            "create",
            "--memory-mib",
            "256",
            "-m",
            "owner=cli",
        ],
    )
    .await;
    let id = out.trim().to_owned();
    assert_eq!(out, format!("{id}\n"));
    assert_eq!(stack.state_of(&id).await, "running");

    // ls and get, for people and for programs.
    let table = ok(&user, &["sandbox", "ls"]).await;
    let header = table.lines().next().unwrap();
    assert!(
        header.starts_with("ID") && header.contains("STATE"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("running")),
        "{table}"
    );
    let listed: Value =
        serde_json::from_str(&ok(&user, &["sandbox", "ls", "--json", "-m", "owner=cli"]).await)
            .unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["id"], id.as_str());
    let none: Value =
        serde_json::from_str(&ok(&user, &["sandbox", "ls", "--json", "-m", "owner=other"]).await)
            .unwrap();
    assert_eq!(none, serde_json::json!([]));
    let detail = ok(&user, &["sandbox", "get", &id]).await;
    assert!(
        detail
            .lines()
            .any(|l| l.starts_with("state:") && l.ends_with("running")),
        "{detail}"
    );
    let got: Value =
        serde_json::from_str(&ok(&user, &["sandbox", "get", &id, "--json"]).await).unwrap();
    assert_eq!(got["metadata"]["owner"], "cli");

    // exec: stdout and stderr apart, the command's own exit code.
    let run = user
        .run(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ])
        .await;
    assert_eq!(
        (run.code, run.stdout.as_str(), run.stderr.as_str()),
        (3, "out\n", "err\n"),
        "{run:?}"
    );
    let run = user
        .run_with(
            &["sandbox", "exec", "-i", &id, "--", "cat"],
            Some(b"piped in"),
        )
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (0, "piped in"), "{run:?}");
    let run = user
        .run(&[
            "sandbox",
            "exec",
            &id,
            "-e",
            "GREETING=hi",
            "-w",
            "/tmp",
            "--",
            "sh",
            "-c",
            "echo $GREETING $(pwd)",
        ])
        .await;
    assert_eq!(run.stdout, "hi /tmp\n", "{run:?}");
    exec_streams_output_while_the_command_runs(&stack, &user, &id).await;

    // cp both ways, a 3 MiB file through several chunks, and to stdout.
    let local = user.home.join("big.bin");
    let data: Vec<u8> = (0..3 * 1024 * 1024u32)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    std::fs::write(&local, &data).unwrap();
    ok(
        &user,
        &[
            "sandbox",
            "cp",
            local.to_str().unwrap(),
            &format!("{id}:/root/"),
        ],
    )
    .await;
    let run = user
        .run(&["sandbox", "exec", &id, "--", "wc", "-c", "/root/big.bin"])
        .await;
    assert!(run.stdout.starts_with(&data.len().to_string()), "{run:?}");
    let back = user.home.join("back.bin");
    ok(
        &user,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/root/big.bin"),
            back.to_str().unwrap(),
        ],
    )
    .await;
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the file came back whole"
    );
    let into_dir = user.home.join("dir");
    std::fs::create_dir(&into_dir).unwrap();
    ok(
        &user,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/root/big.bin"),
            into_dir.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(
        std::fs::metadata(into_dir.join("big.bin")).unwrap().len(),
        data.len() as u64
    );
    ok(
        &user,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "printf hello > /root/small",
        ],
    )
    .await;
    let out = ok(&user, &["sandbox", "cp", &format!("{id}:/root/small"), "-"]).await;
    assert_eq!(out, "hello");
    let run = user
        .run(&["sandbox", "cp", &format!("{id}:/root"), "-"])
        .await;
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains("is a directory"), "{run:?}");
    let run = user
        .run(&["sandbox", "cp", &format!("{id}:/root/nope"), "-"])
        .await;
    assert_eq!(run.code, 66, "{run:?}");

    // Events and a preview token.
    let events = ok(&user, &["sandbox", "events", &id]).await;
    assert!(events.starts_with("AT"), "{events}");
    assert!(events.lines().any(|l| l.contains("running")), "{events}");
    let preview = ok(&user, &["sandbox", "preview", &id, "8080", "--json"]).await;
    let preview: Value = serde_json::from_str(&preview).unwrap();
    assert!(preview["url"].as_str().unwrap().contains(&id), "{preview}");
    assert!(preview["token"].is_string(), "{preview}");

    // stop (while `events --follow` watches), an exec on the stopped sandbox (a conflict:
    // 75), start, rm.
    let mut follower = user
        .command(&["sandbox", "events", &id, "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut followed = follower.stdout.take().unwrap();
    let mut seen = Vec::new();
    read_until(&mut followed, &mut seen, "running").await;
    let out = ok(&user, &["sandbox", "stop", &id]).await;
    assert_eq!(out, format!("{id} stopped\n"));
    read_until(&mut followed, &mut seen, "sandbox.stopped").await;
    follower.start_kill().unwrap();
    follower.wait().await.unwrap();
    let run = user.run(&["sandbox", "exec", &id, "--", "true"]).await;
    assert_eq!(run.code, 75, "{run:?}");
    assert!(
        run.stderr.starts_with("berth: ") && run.stderr.contains("conflict"),
        "{run:?}"
    );
    let out = ok(&user, &["sandbox", "start", &id]).await;
    assert_eq!(out, format!("{id} running\n"));
    let out = ok(&user, &["sandbox", "rm", &id]).await;
    assert_eq!(out, format!("{id} deleted\n"));
    assert_eq!(stack.state_of(&id).await, "deleted");

    // Shell completions name the subcommands.
    let bash = ok(&user, &["completions", "bash"]).await;
    assert!(
        bash.contains("sandbox") && bash.contains("exec"),
        "{}",
        &bash[..200.min(bash.len())]
    );

    login_writes_a_private_config_that_later_commands_use(&stack).await;
    stack.assert_no_capacity_drift().await;
}

/// Reads `from` into `seen` until it holds `want`.
async fn read_until(from: &mut tokio::process::ChildStdout, seen: &mut Vec<u8>, want: &str) {
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(seen).contains(want) {
        let n = tokio::time::timeout(SETTLE_TIMEOUT, from.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("never saw {want:?}: {}", String::from_utf8_lossy(seen)))
            .unwrap();
        assert!(
            n > 0,
            "ended before {want:?}: {}",
            String::from_utf8_lossy(seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
}

/// `exec` writes output as it arrives: the first line is there while the command still waits
/// for a file only the test creates afterwards.
async fn exec_streams_output_while_the_command_runs(stack: &Stack, user: &User, id: &str) {
    let mut child = user
        .command(&[
            "sandbox",
            "exec",
            id,
            "--",
            "sh",
            "-c",
            "echo first; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo second",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("first\n") {
        let n = tokio::time::timeout(SETTLE_TIMEOUT, stdout.read(&mut buf))
            .await
            .expect("the first line arrives")
            .unwrap();
        assert!(n > 0, "ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "still running after its first line"
    );
    let (status, _) = stack.exec(id, &["touch", "/tmp/go"]).await;
    assert_eq!(status, 200);
    stdout.read_to_end(&mut seen).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&seen), "first\nsecond\n");
    assert_eq!(child.wait().await.unwrap().code(), Some(0));
}

/// `berth login` checks the key, writes it mode 0600, and a command without `BERTH_API_KEY`
/// then uses it; a refused key writes nothing.
async fn login_writes_a_private_config_that_later_commands_use(stack: &Stack) {
    let bad = User::with(&stack.base, Some("berth_not-a-key"));
    let run = bad.run(&["login"]).await;
    assert_eq!(run.code, 77, "{run:?}");
    assert!(!bad.config_path().exists(), "a refused key is not saved");

    let user = User::with(&stack.base, None);
    let run = user
        .run_with(&["login"], Some(format!("{}\n", stack.key).as_bytes()))
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(mode_of(&user.config_path()), 0o600);
    assert_eq!(mode_of(user.config_path().parent().unwrap()), 0o700);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(user.config_path()).unwrap()).unwrap();
    assert_eq!(config["api_key"], stack.key.as_str());
    assert_eq!(config["api_url"], stack.base.as_str());
    // No key in the environment, nor the URL: both come from the file.
    let mut command = user.command(&["sandbox", "ls", "--json"]);
    command.env_remove("BERTH_API_URL");
    let output = command.output().await.unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert!(serde_json::from_slice::<Value>(&output.stdout)
        .unwrap()
        .is_array());
}
