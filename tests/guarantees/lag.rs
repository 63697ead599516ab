//! Issue 12 item 1 end to end: a real hostd whose heartbeats the control plane applies
//! seconds late (a backlogged heartbeat consumer) — the reconciler fails no running sandbox on
//! those stale inventories, and still fails a guest that really died.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use sqlx::PgPool;

use crate::support::http::host_of;
use crate::support::{eventually, Stack};

/// How late every heartbeat is applied: far more than the pass's inventory grace, so under
/// the old rule (judge on any heartbeat that *arrived* after the grace) a heartbeat taken
/// before the sandbox ran would fail it.
const INGEST_DELAY: Duration = Duration::from_secs(3);

/// Whether `host`'s applied inventory lists `sandbox` and was taken after the row's last change.
async fn listed_after_change(db: &PgPool, host: uuid::Uuid, sandbox: &str) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM hosts h, sandboxes s,
                        jsonb_array_elements(h.inventory) i
                 WHERE h.id = $1 AND s.id = $2::uuid AND i->>'sandbox_id' = $2
                   AND h.heartbeat_sent_at > s.updated_at)",
    )
    .bind(host)
    .bind(sandbox)
    .fetch_one(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_backlogged_heartbeat_consumer_fails_no_running_sandbox_but_a_dead_guest_still_fails(
    db: PgPool,
) {
    let pass = PassConfig {
        interval: Duration::from_millis(100),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let mut stack = Stack::start_with_delayed_heartbeats(db, pass, INGEST_DELAY).await;
    stack
        .add_host_with_args(
            (None, None),
            &["--heartbeat-interval".to_owned(), "300ms".to_owned()],
        )
        .await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let host = host_of(&stack, &id).await;
    // For INGEST_DELAY after it ran, every heartbeat applied was taken before: its inventory
    // lacks the sandbox while the pass runs every 100 ms.
    let db = stack.db.clone();
    for round in 0..2 {
        eventually(
            &format!("inventory {round} taken after the sandbox ran is applied"),
            || {
                let (db, id) = (db.clone(), id.clone());
                async move { listed_after_change(&db, host, &id).await }
            },
        )
        .await;
    }
    let events: Vec<String> =
        sqlx::query_scalar("SELECT to_state FROM events WHERE sandbox_id = $1::uuid ORDER BY at")
            .bind(&id)
            .fetch_all(&stack.db)
            .await
            .unwrap();
    assert_eq!(
        events.last().map(String::as_str),
        Some("running"),
        "no false failure: {events:?}"
    );

    // A guest that really dies is still failed, on evidence that arrives late.
    let _ = stack.exec(&id, &["sh", "-c", "kill -9 $PPID"]).await;
    let failed = stack.wait_state(&id, "failed-start").await;
    assert!(
        failed["state_reason"].as_str().unwrap().contains("guest"),
        "{failed}"
    );
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
