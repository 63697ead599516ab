//! Auto-resume: a request for a sleeping sandbox starts it and waits until it runs.
//!
//! The start is the lifecycle use case of `POST /v1/sandboxes/{id}/start`
//! ([`crate::service::sandboxes::lifecycle`]): it locks the row, and the state machine turns a
//! second start of a sandbox already `starting` into a no-op, so any number of concurrent
//! wakers — in this process or in several proxies — issue one start command. A `stopping`
//! sandbox is waited for until it is `stopped`, then started (a start while `stopping` is a
//! conflict in the state machine).
//!
//! Waiting polls the row with a backoff from [`POLL_FIRST`] to [`POLL_MAX`], bounded by
//! [`super::PreviewConfig::wake_timeout`].

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use berth_schemas::state::Request as LifecycleRequest;
use berth_schemas::SandboxState;

use super::page::Page;
use super::routes::Route;
use super::Preview;
use crate::service::sandboxes::lifecycle;
use crate::service::ServiceError;

/// The first pause between two looks at a waking sandbox's row.
pub const POLL_FIRST: Duration = Duration::from_millis(50);
/// The longest pause between two looks.
pub const POLL_MAX: Duration = Duration::from_millis(500);
/// `Retry-After` of a request that waited its bound, in seconds.
pub const RETRY_AFTER_SECS: u64 = 5;

/// Starts `route`'s sandbox when it is stopped (and `auto_resume`), and waits until it runs.
///
/// Errors: 409 with the state without `auto_resume`, or in a state no start leads out of
/// (`failed-start`, archived, …); 404 when it is deleted meanwhile; 503 with `Retry-After`
/// when it does not run within the wake timeout, or no host has room for it.
pub async fn until_running(preview: &Preview, route: &Route) -> Result<Route, Page> {
    let started = Instant::now();
    let deadline = started + preview.config.wake_timeout;
    let mut pause = POLL_FIRST;
    let mut route = route.clone();
    let mut woke = false;
    loop {
        match route.state {
            SandboxState::Running => {
                if woke {
                    metrics::histogram!("berth_preview_wake_seconds")
                        .record(started.elapsed().as_secs_f64());
                }
                return Ok(route);
            }
            SandboxState::Stopped | SandboxState::Stopping if !route.auto_resume => {
                return Err(Page::conflict(
                    route.state,
                    "auto_resume is off, so a preview request does not start it",
                ));
            }
            SandboxState::Stopped => {
                start(preview, &route).await?;
                woke = true;
            }
            SandboxState::Stopping
            | SandboxState::Provisioning
            | SandboxState::Starting
            | SandboxState::Resuming
            | SandboxState::Restoring
            | SandboxState::Migrating
            | SandboxState::Unarchiving => {}
            other => {
                return Err(Page::conflict(other, "a preview request cannot wake it"));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Page::waking(RETRY_AFTER_SECS));
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(POLL_MAX);
        route = preview
            .routes
            .read(&preview.db, route.sandbox)
            .await?
            .ok_or_else(|| Page::not_found(route.sandbox))?;
    }
}

/// Asks for a start (a no-op when one is under way).
async fn start(preview: &Preview, route: &Route) -> Result<(), Page> {
    let outcome = lifecycle(
        &preview.db,
        preview.overcommit,
        route.org,
        route.sandbox,
        LifecycleRequest::Start,
        None,
        |_| {
            Ok(crate::service::idempotency::StoredResponse {
                status: StatusCode::ACCEPTED.as_u16(),
                body: serde_json::Value::Null,
            })
        },
    )
    .await;
    match outcome {
        Ok(_) => {
            tracing::info!(sandbox_id = %route.sandbox, "preview request woke the sandbox");
            Ok(())
        }
        // Its state moved under us (stopping again, deleted): the next look decides.
        Err(ServiceError::Conflict { .. }) => Ok(()),
        Err(ServiceError::NotFound(_)) => Err(Page::not_found(route.sandbox)),
        Err(ServiceError::NoCapacity { .. }) | Err(ServiceError::QuotaExceeded { .. }) => {
            let mut page = Page::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "The sandbox cannot start right now (no room for it); try again later.",
            );
            page.retry_after = Some(RETRY_AFTER_SECS);
            Err(page)
        }
        Err(e) => {
            tracing::warn!(sandbox_id = %route.sandbox, error = %e, "preview wake failed");
            Err(Page::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "The sandbox could not be started; try again shortly.",
            ))
        }
    }
}
