//! What goes wrong, as a user of the CLI sees it: a wrong key, no key, an unknown sandbox, an
//! invalid request, a sandbox that is not running and an API that is down each get a one-line
//! `berth: …` message naming the problem and an exit code of their own (`sysexits.h`); another
//! org's sandbox is not found on any of them, the shell included.

use sqlx::PgPool;

use crate::kit::User;
use crate::support::Stack;

/// The exit codes of `src/cli/client.rs`.
const USAGE: i32 = 64;
const NOT_FOUND: i32 = 66;
const UNAVAILABLE: i32 = 69;
const TEMPFAIL: i32 = 75;
const NOPERM: i32 = 77;
const CONFIG: i32 = 78;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_wrong_key_an_unknown_sandbox_and_an_api_that_is_down_get_clear_messages_and_codes(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let unknown = "01234567-89ab-7def-8123-456789abcdef";

    // A wrong key, on a plain request, an exec stream and a shell.
    let wrong = User::with(&stack.base, Some("berth_wrong"));
    for args in [
        vec!["sandbox", "ls"],
        vec!["sandbox", "exec", unknown, "--", "true"],
        vec!["sandbox", "shell", unknown],
        vec!["template", "ls"],
    ] {
        let run = wrong.run(&args).await;
        assert_eq!(run.code, NOPERM, "{args:?}: {run:?}");
        assert!(
            run.stderr.starts_with("berth: the API refused the key")
                && run.stderr.contains("berth login"),
            "{args:?}: {run:?}"
        );
        assert!(run.stdout.is_empty());
    }

    // No key at all.
    let keyless = User::with(&stack.base, None);
    let run = keyless.run(&["sandbox", "ls"]).await;
    assert_eq!(run.code, CONFIG, "{run:?}");
    assert!(run.stderr.contains("BERTH_API_KEY"), "{run:?}");

    // An unknown sandbox, on every kind of route.
    let user = User::of(&stack);
    for args in [
        vec!["sandbox", "get", unknown],
        vec!["sandbox", "exec", unknown, "--", "true"],
        vec!["sandbox", "shell", unknown],
        vec!["sandbox", "stop", unknown],
        vec!["sandbox", "rm", unknown],
        vec!["sandbox", "events", unknown],
        vec!["sandbox", "cp", &format!("{unknown}:/etc/hostname"), "-"],
    ] {
        let run = user.run(&args).await;
        assert_eq!(run.code, NOT_FOUND, "{args:?}: {run:?}");
        assert!(
            run.stderr.starts_with("berth: ") && run.stderr.contains("not_found"),
            "{args:?}: {run:?}"
        );
    }
    // A malformed id is refused the same way, not sent to another route.
    let run = user.run(&["sandbox", "get", "../templates"]).await;
    assert!(matches!(run.code, NOT_FOUND | USAGE), "{run:?}");

    // An invalid request and a sandbox that is not running.
    let id = crate::support::http::stopped_sandbox(&stack).await;
    let run = user
        .run(&["sandbox", "exec", &id, "--timeout", "11m", "--", "true"])
        .await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(run.stderr.contains("timeout_ms"), "{run:?}");
    for args in [
        vec!["sandbox", "exec", id.as_str(), "--", "true"],
        vec!["sandbox", "shell", id.as_str()],
    ] {
        let run = user.run(&args).await;
        assert_eq!(run.code, TEMPFAIL, "{args:?}: {run:?}");
        assert!(run.stderr.contains("stopped"), "{args:?}: {run:?}");
    }

    // Another org's sandbox is as unknown as one that does not exist, the shell too.
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "other")
        .await
        .unwrap();
    let intruder = User::with(&stack.base, Some(&other_key));
    for args in [
        vec!["sandbox", "get", id.as_str()],
        vec!["sandbox", "shell", id.as_str()],
        vec!["sandbox", "start", id.as_str()],
    ] {
        let run = intruder.run(&args).await;
        assert_eq!(run.code, NOT_FOUND, "{args:?}: {run:?}");
    }
    let running = crate::support::http::running_sandbox(&stack).await;
    for args in [
        vec!["sandbox", "exec", running.as_str(), "--", "true"],
        vec!["sandbox", "shell", running.as_str()],
        vec!["sandbox", "cp", &format!("{running}:/etc/hostname"), "-"],
    ] {
        let run = intruder.run(&args).await;
        assert_eq!(run.code, NOT_FOUND, "{args:?}: {run:?}");
    }

    // An API that is down: a port nothing listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let down = User::with(&format!("http://{closed}"), Some(&stack.key));
    for args in [
        vec!["sandbox", "ls"],
        vec!["sandbox", "exec", &id, "--", "true"],
        vec!["sandbox", "shell", &id],
    ] {
        let run = down.run(&args).await;
        assert_eq!(run.code, UNAVAILABLE, "{args:?}: {run:?}");
        assert!(
            run.stderr.starts_with(&format!(
                "berth: cannot reach the Berth API at http://{closed}"
            )),
            "{args:?}: {run:?}"
        );
    }
    stack.assert_no_capacity_drift().await;
}
