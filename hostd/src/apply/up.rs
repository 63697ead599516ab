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
use crate::warm::Shape;

/// Create, or start: make the sandbox run. Without a live record (a start after a failed
/// create) this is a full create from `cmd.spec`. A failed fresh create undoes everything and
/// leaves the record as [`Phase::FailedCreate`]; a failed start undoes only what it built.
pub async fn up(
    host: &Arc<Host>,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    // A warm pool sandbox the command names (the API gave the create its id): handed over
    // when it has the create's shape, else removed and built anew under that id.
    let (live, pooled) = match live {
        Some(r) if r.warm => match take_over(host, cmd, r).await {
            Ok(taken) => taken,
            Err(error) => {
                let reason = error.result_reason();
                tracing::warn!(error = %error.report(), "warm sandbox not removed");
                return (None, ResultOutcome::Failed { reason });
            }
        },
        live => (live, false),
    };
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
    let brought_up = if pooled {
        host.backend
            .hand_over(host, &mut record, &mut cleanup)
            .await
    } else {
        host.backend
            .bring_up(host, &mut record, fresh, &mut cleanup)
            .await
    };
    match brought_up {
        Ok(address) => {
            crate::fault::crash_point(crate::fault::Step::Agent);
            cleanup.disarm();
            record.phase = Phase::Running;
            tracing::info!(%address, elapsed = ?started.elapsed(), fresh, pooled, "sandbox running");
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

/// Takes over a warm pool sandbox (`record`, `warm`) for `cmd`. Of the create's shape, the
/// record becomes the create's (its spec, no longer warm, `Creating`) and is returned to be
/// handed over (`true`). Of another shape (or a command without a spec), the sandbox is removed
/// whole and there is no live record (`None`, `false`): the command builds it anew.
///
/// Errors: the removal's; the command fails and a later delete removes what is left.
async fn take_over(
    host: &Host,
    cmd: &Command,
    mut record: SandboxRecord,
) -> Result<(Option<SandboxRecord>, bool), crate::error::HostdError> {
    match &cmd.spec {
        Some(spec) if Shape::of(spec) == Shape::of(&record.spec) => {
            record.spec = spec.clone();
            record.warm = false;
            record.phase = Phase::Creating;
            host.put(&record)?;
            Ok((Some(record), true))
        }
        _ => {
            tracing::info!("the warm sandbox is not of the create's shape; building anew");
            ::metrics::counter!(crate::warm::WARM_HANDOVERS, "result" => "rebuilt").increment(1);
            crate::apply::delete::remove_everything(host, record.sandbox_id, Some(&record)).await?;
            host.forget(record.sandbox_id);
            Ok((None, false))
        }
    }
}
