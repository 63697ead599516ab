//! Create and start, one use case: make the sandbox run. A create redelivered after a crash
//! finishes as a start would, and a start without a live record (after a failed create) is a
//! full create from the command's spec, so the two commands share every step; splitting them
//! would only copy this file.
//!
//! The steps that touch the machine are the backend's ([`crate::host::Backend::bring_up`]);
//! this file owns the record, the cleanup stack and the outcome.

use std::sync::Arc;
use std::time::Instant;

use berth_schemas::wire::{Command, ResultOutcome};

use crate::cleanup::CleanupStack;
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};

/// Create, or start: make the sandbox run. Without a live record (a start after a failed
/// create) this is a full create from `cmd.spec`. A failed fresh create undoes everything and
/// leaves the record as [`Phase::FailedCreate`]; a failed start undoes only what it built.
pub async fn up(
    host: &Arc<Host>,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let (mut record, fresh) = match live {
        Some(r) => {
            let fresh = r.phase == Phase::Creating;
            (r, fresh)
        }
        None => match super::new_record(host, cmd) {
            Some(r) => (r, true),
            None => {
                let reason = "no local record, and the command carries no spec".to_owned();
                return (None, ResultOutcome::Rejected { reason });
            }
        },
    };
    let mut cleanup = CleanupStack::new();
    let started = Instant::now();
    host.gates.open(record.sandbox_id);
    let brought_up = host
        .backend
        .bring_up(host, &mut record, fresh, &mut cleanup)
        .await;
    match brought_up {
        Ok(address) => {
            crate::fault::crash_point(crate::fault::Step::Agent);
            cleanup.disarm();
            record.phase = Phase::Running;
            tracing::info!(%address, elapsed = ?started.elapsed(), fresh, "sandbox running");
            let outcome = ResultOutcome::Succeeded {
                address: Some(address.to_string()),
                last_stop: None,
            };
            (Some(record), outcome)
        }
        Err(error) => {
            let requests_fault = error.is_the_requests_fault();
            // The result (the sandbox's `state_reason`, shown by the API) says what failed
            // without host paths; the log keeps the whole report.
            let mut reason = error.result_reason();
            let mut report = error.report();
            if let Err(cleanup_error) = cleanup.run().await {
                reason = format!("{reason}; {}", cleanup_error.result_reason());
                report = format!("{report}; {}", cleanup_error.report());
            }
            tracing::warn!(error = %report, fresh, requests_fault, "bring-up failed");
            if fresh {
                record.phase = Phase::FailedCreate;
                record.link = None;
            }
            let outcome = if requests_fault {
                ResultOutcome::Rejected { reason }
            } else {
                ResultOutcome::Failed { reason }
            };
            (Some(record), outcome)
        }
    }
}
