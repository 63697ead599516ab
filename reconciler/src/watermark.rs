//! The results watermark: the time (database clock) before which every result a host published
//! has been applied. The command timeouts of the leader's pass count to it, not to now
//! ([`berth_store::sandboxes::lock_timed_out`]), so a result that waits in the control plane's
//! own backlog never turns into a false timeout (issue 12 item 1).
//!
//! Each reconciler process samples it every [`SAMPLE_INTERVAL`]: first the database's clock
//! `T`, then the results stream's last sequence `L` (every result published before `T` has a
//! sequence at most `L`), then the shared consumer's ack floor `F` (every result at or below
//! `F` was applied or refused, and acked). A sample whose `L` the floor has reached moves the
//! watermark to its `T`; a consumer with nothing pending or unacked has reached every sample
//! taken before it. Samples not yet reached wait, at most [`MAX_SAMPLES`] of them (the oldest
//! dropped first: the watermark then moves later, never wrongly).
//!
//! `berth_results_watermark_lag_seconds`: how far the watermark trails the database clock (a
//! backlog of results, or a consumer that stopped); alert `BerthResultsBacklogged`.

use std::collections::VecDeque;
use std::time::Duration;

use async_nats::jetstream;
use berth_schemas::Subjects;
use berth_store::commands;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// How often a process samples the watermark.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// Samples kept while the consumer has not reached them: 10 minutes of them at one a second.
pub const MAX_SAMPLES: usize = 600;

/// One reading: the database clock (µs since the epoch) and the stream's last sequence after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sample {
    at_us: i64,
    last_sequence: u64,
}

/// The consumer's progress at one reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Progress {
    /// Every stream sequence at or below this was acked.
    ack_floor: u64,
    /// Nothing was left to deliver or to ack.
    caught_up: bool,
}

/// The samples waiting for the consumer to reach them.
#[derive(Debug, Default)]
struct Samples(VecDeque<Sample>);

impl Samples {
    /// Adds `sample`, taken just before `progress` was read, and returns the newest time the
    /// consumer has reached (every result published before it is applied), if any.
    fn advance(&mut self, sample: Sample, progress: Progress) -> Option<i64> {
        if progress.caught_up {
            self.0.clear();
            return Some(sample.at_us);
        }
        self.0.push_back(sample);
        if self.0.len() > MAX_SAMPLES {
            self.0.pop_front();
        }
        let mut reached = None;
        while let Some(oldest) = self.0.front() {
            if oldest.last_sequence > progress.ack_floor {
                break;
            }
            reached = Some(oldest.at_us);
            self.0.pop_front();
        }
        reached
    }
}

/// Samples the watermark until `shutdown` fires; a failed reading (JetStream or the database
/// unreachable) is skipped, and the watermark stays where it was.
pub async fn run(
    db: PgPool,
    nats: async_nats::Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) {
    metrics::describe_gauge!(
        "berth_results_watermark_lag_seconds",
        "How far (s) the results watermark trails the database clock: results published before \
         it are all applied; command timeouts count to it"
    );
    let js = jetstream::new(nats);
    let mut samples = Samples::default();
    let mut every = tokio::time::interval(SAMPLE_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        if let Err(error) = sample_once(&db, &js, &subjects, &mut samples).await {
            debug!(%error, "results watermark not sampled");
        }
    }
}

async fn sample_once(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
    samples: &mut Samples,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let at_us = commands::database_now(db).await?;
    let stream = js.get_stream_no_info(subjects.result_stream()).await?;
    let last_sequence = stream.get_info().await?.state.last_sequence;
    let consumer = stream.consumer_info(subjects.reconciler_consumer()).await?;
    let progress = Progress {
        ack_floor: consumer.ack_floor.stream_sequence,
        caught_up: consumer.num_pending == 0 && consumer.num_ack_pending == 0,
    };
    let sample = Sample {
        at_us,
        last_sequence,
    };
    if let Some(reached) = samples.advance(sample, progress) {
        commands::advance_results_watermark(db, reached).await?;
    }
    if let Some(lag) = commands::results_watermark_lag(db).await? {
        metrics::gauge!("berth_results_watermark_lag_seconds").set(lag.max(0.0));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_us: i64, last_sequence: u64) -> Sample {
        Sample {
            at_us,
            last_sequence,
        }
    }

    fn behind(ack_floor: u64) -> Progress {
        Progress {
            ack_floor,
            caught_up: false,
        }
    }

    #[test]
    fn a_consumer_with_nothing_pending_has_reached_the_sample_taken_before_it() {
        let mut s = Samples::default();
        assert_eq!(s.advance(sample(10, 5), behind(3)), None);
        let caught_up = Progress {
            ack_floor: 0,
            caught_up: true,
        };
        assert_eq!(s.advance(sample(20, 9), caught_up), Some(20));
        assert!(s.0.is_empty(), "older samples are reached too");
    }

    #[test]
    fn the_watermark_is_the_newest_sample_the_ack_floor_reached_and_waits_for_the_rest() {
        let mut s = Samples::default();
        assert_eq!(s.advance(sample(10, 100), behind(40)), None);
        assert_eq!(s.advance(sample(20, 150), behind(99)), None);
        // The floor passed the first two samples' sequences, not the third's.
        assert_eq!(s.advance(sample(30, 400), behind(150)), Some(20));
        assert_eq!(s.advance(sample(40, 400), behind(399)), None);
        assert_eq!(s.advance(sample(50, 420), behind(400)), Some(40));
    }

    #[test]
    fn a_backlog_longer_than_the_kept_samples_drops_the_oldest_and_never_moves_early() {
        let mut s = Samples::default();
        for i in 0..(MAX_SAMPLES as i64 + 10) {
            assert_eq!(s.advance(sample(i, 1_000 + i as u64), behind(0)), None);
        }
        assert_eq!(s.0.len(), MAX_SAMPLES);
        // The floor reaches the sequence of sample 20, which was dropped: the watermark moves
        // to the oldest kept sample at or below the floor, never past what was reached.
        assert_eq!(s.advance(sample(10_000, 5_000), behind(1_020)), Some(20));
    }
}
