//! `berth sandbox archive` against a real stack with one runc host: a running sandbox is
//! refused (75: a conflict), a stopped one is archived and waited for, `--no-wait` answers
//! `archiving`, and `start` brings an archived sandbox back with its files.

use serde_json::Value;
use sqlx::PgPool;

use crate::kit::{ok, User};
use crate::support::Stack;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_cli_archives_a_stopped_sandbox_and_starts_it_again(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);
    let id = ok(&user, &["sandbox", "create", "--memory-mib", "256"])
        .await
        .trim()
        .to_owned();
    let exec = ["sandbox", "exec", &id, "--", "sh", "-c"];
    ok(&user, &[&exec[..], &["echo kept > /root/f"]].concat()).await;

    // Only a stopped sandbox is archived: a running one is a conflict (75).
    let run = user.run(&["sandbox", "archive", &id]).await;
    assert_eq!(run.code, 75, "{run:?}");
    assert!(run.stderr.contains("conflict"), "{run:?}");

    ok(&user, &["sandbox", "stop", &id]).await;
    let out = ok(&user, &["sandbox", "archive", &id]).await;
    assert_eq!(out, format!("{id} archived\n"));
    assert_eq!(stack.state_of(&id).await, "archived");
    // Again: already archived, nothing changes.
    let json: Value =
        serde_json::from_str(&ok(&user, &["sandbox", "archive", &id, "--json"]).await)
            .expect("JSON");
    assert_eq!(json[0]["state"], "archived", "{json}");

    let out = ok(&user, &["sandbox", "start", &id]).await;
    assert_eq!(out, format!("{id} running\n"));
    let out = ok(&user, &[&exec[..], &["cat /root/f"]].concat()).await;
    assert_eq!(out, "kept\n");

    // `--no-wait` answers once accepted.
    ok(&user, &["sandbox", "stop", &id]).await;
    let out = ok(&user, &["sandbox", "archive", &id, "--no-wait"]).await;
    assert_eq!(out, format!("{id} archiving\n"));
    stack.wait_state(&id, "archived").await;
    ok(&user, &["sandbox", "rm", &id]).await;
    stack.teardown().await;
}
