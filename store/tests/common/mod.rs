//! Fixtures the store's integration tests share: a host row heard from just now, a sandbox
//! placed on it holding its reservation (as a create leaves it), a transition, and a
//! `creating` snapshot row.

// Each test binary uses its own part of these.
#![allow(dead_code)]

use berth_schemas::ids::SnapshotId;
use berth_schemas::wire::{Heartbeat, Resources, Runtime, RuntimeInfo};
use berth_schemas::{
    Capacity, CommandId, CommandKind, HostId, OrgId, Reason, SandboxId, SandboxState,
};
use berth_store::hosts::{self, Admit, Overcommit};
use berth_store::sandboxes::{self, NewSandbox, Transition};
use berth_store::snapshots::{self, NewSnapshot};
use berth_store::{orgs, SandboxRow};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

pub const HOST_CAPACITY: Resources = Resources {
    vcpus: 2,
    memory_mib: 1024,
};
pub const SIZE: Resources = Resources {
    vcpus: 1,
    memory_mib: 512,
};

/// A host heard from just now, with [`HOST_CAPACITY`].
pub async fn host(db: &PgPool) -> HostId {
    let id = HostId::new();
    hosts::upsert_heartbeat(
        db,
        &Heartbeat {
            host_id: id,
            name: "store-test".into(),
            seq: 1,
            capacity: HOST_CAPACITY,
            used: Resources::default(),
            runtimes: vec![RuntimeInfo {
                name: "runc".into(),
                memory_snapshot: false,
            }],
            inventory: vec![],
            forwarder: None,
            sent_at_ms: 0,
            warm: Vec::new(),
        },
    )
    .await
    .unwrap();
    id
}

/// A `provisioning` sandbox placed on `host`, holding its reservation (as a create leaves it).
pub async fn placed(db: &PgPool, host: HostId) -> SandboxRow {
    placed_as(db, host, None).await
}

/// [`placed`], under `id` when given (as a create that claimed a warm slot).
pub async fn placed_as(db: &PgPool, host: HostId, id: Option<SandboxId>) -> SandboxRow {
    let org = orgs::create(db, &format!("org-{}", OrgId::new()))
        .await
        .unwrap()
        .unwrap();
    let mut tx = db.begin().await.unwrap();
    assert!(hosts::reserve(
        &mut tx,
        host,
        SIZE,
        Overcommit::default(),
        Admit::NewSandbox
    )
    .await
    .unwrap());
    let (row, _) = sandboxes::create(
        &mut tx,
        NewSandbox {
            id,
            network: Default::default(),
            image: None,
            org_id: org,
            template: "base".into(),
            runtime: Runtime::Runc,
            host_id: host,
            resources: SIZE,
            metadata: serde_json::json!({}),
            auto_stop_minutes: None,
            auto_delete_minutes: None,
            auto_archive_days: None,
            backup_interval_min: None,
            disk_mib: 256,
            auto_resume: true,
            public_ports: vec![],
            expires_at: None,
            on_expiry: Default::default(),
            env: Vec::new(),
            entrypoint: Vec::new(),
            image_uri: None,
            from_snapshot: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    row
}

pub fn transition(
    to: SandboxState,
    command: CommandKind,
    capacity: Capacity,
) -> Transition<'static> {
    Transition {
        to,
        command: Some(command),
        capacity,
        reason: Reason::UserRequest,
        delete: false,
        message: None,
        activity: true,
        overcommit: Overcommit {
            cpu: 1.0,
            memory: 1.0,
        },
        snapshot: None,
    }
}

/// Inserts a `creating` snapshot of `org` (of `sandbox`, with `parent`) whose row is `ago`
/// seconds old on the database's clock, and commits; its id and `created_at` (the time its
/// upload's chunk check is judged against, `chunks::check_for_ready`).
pub async fn creating_snapshot(
    db: &PgPool,
    org: OrgId,
    sandbox: SandboxId,
    parent: Option<SnapshotId>,
    ago: f64,
) -> (SnapshotId, DateTime<Utc>) {
    let id = SnapshotId::new();
    let mut tx = db.begin().await.unwrap();
    snapshots::create(
        &mut tx,
        &NewSnapshot {
            id,
            org_id: org,
            sandbox_id: sandbox,
            host_id: HostId::new(),
            parent_id: parent,
            template: "base",
            runtime: "runc",
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 1024,
            command_id: CommandId::new(),
            expires_at: None,
            kind: snapshots::KIND_SNAPSHOT,
        },
    )
    .await
    .unwrap();
    let created_at = sqlx::query_scalar(
        "UPDATE snapshots SET created_at = created_at - make_interval(secs => $2)
          WHERE id = $1 RETURNING created_at",
    )
    .bind(id)
    .bind(ago)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (id, created_at)
}
