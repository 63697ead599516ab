//! JetStream stream definitions, shared so every component creates them identically
//! (whichever starts first creates; the rest find them).
//!
//! - `{P}_CMD` on `{p}.cmd.>`: commands, work-queue retention (a command is removed once its
//!   host acks it), deduplicated by `Nats-Msg-Id` = command id within [`DUPLICATE_WINDOW`].
//! - `{P}_RESULT` on `{p}.result.>`: results, work-queue retention, acked by the reconciler.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::subjects::Subjects;

/// How long JetStream remembers a `Nats-Msg-Id` to drop a re-publish of the same command.
/// The relay re-publishes only commands it could not mark published, within seconds.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Creates the command and result streams if they do not exist.
///
/// Errors: the JetStream error when a stream cannot be created or looked up.
pub async fn ensure_streams(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<(), async_nats::jetstream::context::CreateStreamError> {
    for (name, subject) in [
        (subjects.cmd_stream(), subjects.cmd_all()),
        (subjects.result_stream(), subjects.result_all()),
    ] {
        js.get_or_create_stream(stream::Config {
            name,
            subjects: vec![subject],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await?;
    }
    Ok(())
}

/// Deletes both streams (tests clean up with this).
pub async fn delete_streams(js: &jetstream::Context, subjects: &Subjects) {
    let _ = js.delete_stream(subjects.cmd_stream()).await;
    let _ = js.delete_stream(subjects.result_stream()).await;
}
