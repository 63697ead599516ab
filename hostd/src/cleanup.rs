//! A last-in-first-out cleanup stack, run at most once, errors joined — the shape of the E2B
//! orchestrator's sandbox teardown.
//!
//! Each step that builds something pushes its undo. On failure the caller runs the stack: every
//! undo is attempted, newest first, even when an earlier one fails. On success the caller
//! disarms it. Undo steps must be idempotent (removing what is already gone succeeds), because a
//! crash between build and undo leaves the work to the next attempt.

use std::future::Future;

use futures::future::BoxFuture;

use crate::error::HostdError;

type Step = Box<dyn FnOnce() -> BoxFuture<'static, Result<(), HostdError>> + Send>;

/// Undo steps, run newest first.
#[must_use = "run the stack on failure or disarm it on success"]
pub struct CleanupStack {
    steps: Vec<(&'static str, Step)>,
}

impl CleanupStack {
    /// An empty stack.
    pub fn new() -> Self {
        Self { steps: Vec::new() }
    }

    /// Pushes an undo step; `what` names it in logs and joined errors.
    pub fn push<F, Fut>(&mut self, what: &'static str, undo: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), HostdError>> + Send + 'static,
    {
        self.steps.push((
            what,
            Box::new(move || Box::pin(undo()) as BoxFuture<'static, _>),
        ));
    }

    /// How many steps are pending.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether no step is pending.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Forgets every step: the work succeeded and is kept.
    pub fn disarm(mut self) {
        self.steps.clear();
    }

    /// Runs every step, newest first.
    ///
    /// Errors: [`HostdError::Cleanup`] listing each failed step (`"<what>: <error>"`), after
    /// all steps were attempted.
    pub async fn run(mut self) -> Result<(), HostdError> {
        let mut errors = Vec::new();
        while let Some((what, undo)) = self.steps.pop() {
            if let Err(e) = undo().await {
                tracing::warn!(step = what, error = %e.report(), "cleanup step failed");
                errors.push(format!("{what}: {}", e.report()));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(HostdError::Cleanup { errors })
        }
    }
}

impl Default for CleanupStack {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CleanupStack {
    fn drop(&mut self) {
        if !self.steps.is_empty() {
            let pending: Vec<&str> = self.steps.iter().map(|(w, _)| *w).collect();
            tracing::warn!(
                ?pending,
                "cleanup stack dropped without running or disarming"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn recorder() -> (Arc<Mutex<Vec<&'static str>>>, CleanupStack) {
        (Arc::new(Mutex::new(Vec::new())), CleanupStack::new())
    }

    fn push_step(
        stack: &mut CleanupStack,
        log: &Arc<Mutex<Vec<&'static str>>>,
        name: &'static str,
        fail: bool,
    ) {
        let log = log.clone();
        stack.push(name, move || async move {
            log.lock().unwrap().push(name);
            if fail {
                Err(HostdError::ShuttingDown)
            } else {
                Ok(())
            }
        });
    }

    #[tokio::test]
    async fn steps_run_newest_first() {
        let (log, mut stack) = recorder();
        for name in ["network", "mount", "container"] {
            push_step(&mut stack, &log, name, false);
        }
        stack.run().await.unwrap();
        assert_eq!(*log.lock().unwrap(), ["container", "mount", "network"]);
    }

    #[tokio::test]
    async fn a_failing_step_does_not_stop_the_others_and_errors_are_joined() {
        let (log, mut stack) = recorder();
        push_step(&mut stack, &log, "a", true);
        push_step(&mut stack, &log, "b", false);
        push_step(&mut stack, &log, "c", true);
        let err = stack.run().await.unwrap_err();
        assert_eq!(*log.lock().unwrap(), ["c", "b", "a"]);
        match err {
            HostdError::Cleanup { errors } => {
                assert_eq!(errors.len(), 2);
                assert!(errors[0].starts_with("c: ") && errors[1].starts_with("a: "));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_disarmed_stack_runs_nothing() {
        let (log, mut stack) = recorder();
        push_step(&mut stack, &log, "a", false);
        assert_eq!(stack.len(), 1);
        stack.disarm();
        assert!(log.lock().unwrap().is_empty());
    }
}
