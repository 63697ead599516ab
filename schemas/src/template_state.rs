//! The state of a template pulled from an OCI image: a pure function from (state, event) to
//! the next state or a typed refusal. The store writes what [`on_event`] decides.
//!
//! | state \ event | pull requested | pull succeeded | pull failed |
//! |---------------|----------------|----------------|-------------|
//! | pulling       | = (one pull)   | ready          | failed      |
//! | ready         | = (kept)       | refused        | refused     |
//! | failed        | pulling        | refused        | refused     |
//!
//! Only a `ready` template may be named by a create. A template that is not from an image
//! (built-in, imported) is `ready` from the start.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The state of a template (`templates.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TemplateState {
    /// Its image is being resolved and pulled; creates naming it are refused.
    Pulling,
    /// Creates may name it.
    Ready,
    /// The last pull failed (`templates.error_code` says why); a new pull request retries.
    Failed,
}

impl TemplateState {
    /// Every state.
    pub const ALL: [TemplateState; 3] = [Self::Pulling, Self::Ready, Self::Failed];

    /// Its spelling in Postgres and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pulling => "pulling",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for TemplateState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TemplateState {
    type Err = crate::state::UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| crate::state::UnknownState(s.to_owned()))
    }
}

/// What happens to a template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateEvent {
    /// Someone asked for the template's image (a `POST /v1/templates` naming the same image, a
    /// create by image).
    PullRequested,
    /// The pull finished: the image is resolved, its layers are cached and unpack cleanly.
    PullSucceeded,
    /// The pull failed.
    PullFailed,
}

/// What [`on_event`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateDecision {
    /// Nothing changes (a pull is already running, or the template is ready).
    Keep,
    /// Move to this state.
    To(TemplateState),
    /// Start a pull and move to `pulling`.
    StartPull,
}

/// A result for a template that is not pulling: a stale pull (another one won) must not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("template is {state}: a pull result is not expected")]
pub struct UnexpectedPullResult {
    /// The template's state.
    pub state: TemplateState,
}

/// The decision for `event` in `state` (see the module table).
///
/// Errors: [`UnexpectedPullResult`] for a pull result when no pull is running.
pub fn on_event(
    state: TemplateState,
    event: TemplateEvent,
) -> Result<TemplateDecision, UnexpectedPullResult> {
    use TemplateEvent as E;
    use TemplateState as S;
    match (state, event) {
        (S::Pulling | S::Ready, E::PullRequested) => Ok(TemplateDecision::Keep),
        (S::Failed, E::PullRequested) => Ok(TemplateDecision::StartPull),
        (S::Pulling, E::PullSucceeded) => Ok(TemplateDecision::To(S::Ready)),
        (S::Pulling, E::PullFailed) => Ok(TemplateDecision::To(S::Failed)),
        (S::Ready | S::Failed, E::PullSucceeded | E::PullFailed) => {
            Err(UnexpectedPullResult { state })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_and_event_has_the_decision_of_the_table() {
        use TemplateDecision as D;
        use TemplateEvent as E;
        use TemplateState as S;
        let table = [
            (S::Pulling, E::PullRequested, Ok(D::Keep)),
            (S::Pulling, E::PullSucceeded, Ok(D::To(S::Ready))),
            (S::Pulling, E::PullFailed, Ok(D::To(S::Failed))),
            (S::Ready, E::PullRequested, Ok(D::Keep)),
            (
                S::Ready,
                E::PullSucceeded,
                Err(UnexpectedPullResult { state: S::Ready }),
            ),
            (
                S::Ready,
                E::PullFailed,
                Err(UnexpectedPullResult { state: S::Ready }),
            ),
            (S::Failed, E::PullRequested, Ok(D::StartPull)),
            (
                S::Failed,
                E::PullSucceeded,
                Err(UnexpectedPullResult { state: S::Failed }),
            ),
            (
                S::Failed,
                E::PullFailed,
                Err(UnexpectedPullResult { state: S::Failed }),
            ),
        ];
        for (state, event, want) in table {
            assert_eq!(on_event(state, event), want, "{state} {event:?}");
        }
    }

    #[test]
    fn states_round_trip_through_their_spelling() {
        for s in TemplateState::ALL {
            assert_eq!(s.as_str().parse::<TemplateState>().unwrap(), s);
        }
        assert!("paused".parse::<TemplateState>().is_err());
    }
}
