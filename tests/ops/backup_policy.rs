//! An org's backup policy on the real stack (issue 14): `berth admin set-backups` gives new
//! sandboxes a default `backup_interval_min` (a create that names one keeps its own; `PATCH
//! null` still turns it off), and the API's collector deletes every ready backup of a sandbox
//! beyond the org's `backups_kept`, with its content, keeping the newest.

use std::time::Duration;

use berth::org_admin::{run as admin, OrgAdminCmd};
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::backups::{backup, settled};
use crate::support::{eventually, Stack};

async fn org_of(db: &PgPool, sandbox: &str) -> String {
    sqlx::query_scalar(
        "SELECT o.name FROM orgs o JOIN sandboxes s ON s.org_id = o.id WHERE s.id = $1::uuid",
    )
    .bind(sandbox)
    .fetch_one(db)
    .await
    .unwrap()
}

async fn create(stack: &Stack, extra: Value) -> Value {
    let mut body = json!({"template": "base", "vcpus": 1, "memory_mib": 256});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (status, created) = stack.call(Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(status, 202, "{created}");
    created
}

/// The sandbox's ready backups, newest first.
async fn ready_backups(db: &PgPool, sandbox: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT id::text FROM snapshots WHERE sandbox_id = $1::uuid AND kind = 'backup'
            AND state = 'ready' ORDER BY created_at DESC",
    )
    .bind(sandbox)
    .fetch_all(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_orgs_backup_policy_sets_new_sandboxes_interval_and_prunes_backups_past_its_retention(
    db: PgPool,
) {
    let stack = Stack::start(db.clone(), 1).await;
    let first = create(&stack, json!({})).await;
    let id = first["id"].as_str().unwrap().to_owned();
    assert_eq!(first["backup_interval_min"], Value::Null, "no default yet");
    let org = org_of(&db, &id).await;

    // Refused: out of range, an unknown org.
    let set = |org: &str, interval_min, no_interval, keep| {
        admin(
            &db,
            OrgAdminCmd::SetBackups {
                org: org.to_owned(),
                interval_min,
                no_interval,
                keep,
            },
        )
    };
    assert!(set(&org, Some(0), false, Some(2)).await.is_err());
    assert!(set(&org, None, false, Some(0)).await.is_err());
    assert!(set("no-such-org", None, false, Some(2)).await.is_err());
    // Each flag changes only its own setting.
    let said = set(&org, Some(720), false, None).await.unwrap();
    assert!(
        said.contains("every 720 min") && said.contains("7 kept"),
        "{said}"
    );
    let said = set(&org, None, false, Some(2)).await.unwrap();
    assert!(
        said.contains("every 720 min") && said.contains("2 kept"),
        "{said}"
    );
    let said = set(&org, None, true, None).await.unwrap();
    assert!(
        said.contains("sandboxes none") && said.contains("2 kept"),
        "{said}"
    );
    let said = set(&org, Some(720), false, None).await.unwrap();
    assert!(
        said.contains("every 720 min") && said.contains("2 kept"),
        "{said}"
    );

    // New sandboxes take the default; one that names its own keeps it; PATCH null turns it off.
    let defaulted = create(&stack, json!({})).await;
    assert_eq!(defaulted["backup_interval_min"], 720, "{defaulted}");
    let own = create(&stack, json!({"backup_interval_min": 30})).await;
    assert_eq!(own["backup_interval_min"], 30, "{own}");
    let (status, patched) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{}", defaulted["id"].as_str().unwrap()),
            Some(json!({"backup_interval_min": null})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["backup_interval_min"], Value::Null);
    assert_eq!(
        first["backup_interval_min"],
        Value::Null,
        "an existing sandbox is not changed"
    );

    // Retention: of four backups, the newest two stay, with their manifests; the older two
    // are deleted, content first. The sandbox still names its newest.
    stack.wait_state(&id, "running").await;
    let mut taken = Vec::new();
    for _ in 0..4 {
        let (status, b) = backup(&stack, &id).await;
        assert_eq!(status, 202, "{b}");
        let b = settled(&stack, b["id"].as_str().unwrap()).await;
        assert_eq!(b["state"], "ready", "{b}");
        taken.push(b["id"].as_str().unwrap().to_owned());
    }
    eventually("backups past the retention are pruned", || async {
        ready_backups(&db, &id).await.len() == 2
    })
    .await;
    let kept = ready_backups(&db, &id).await;
    assert_eq!(kept, vec![taken[3].clone(), taken[2].clone()]);
    let manifest = |b: &str| stack.object_store_dir().join(format!("manifests/{b}.json"));
    for gone in &taken[..2] {
        eventually("a pruned backup's manifest is removed", || async {
            !manifest(gone).exists()
        })
        .await;
    }
    for b in &kept {
        assert!(manifest(b).is_file(), "a kept backup's manifest stays");
    }
    let (_, row) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(row["last_backup_id"], taken[3].as_str(), "{row}");
    // Pruning is steady: nothing more goes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(ready_backups(&db, &id).await.len(), 2);
    stack.teardown().await;
}
