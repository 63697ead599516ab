//! The targets of issue 16, printed beside what the same run measured: one row per target,
//! `met`, `missed` or `not measured` (a figure the run could not take is never filled in).
//!
//! The targets are reached in `berth bench`, never asserted in tests: the machine they are
//! measured on is shared, so the table also prints the floors the figures compare against.

/// How a measured figure compares with its goal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Goal {
    /// At most this many milliseconds.
    MaxMs(f64),
    /// At most this ratio (a figure over another of the same run).
    MaxRatio(f64),
    /// At least this many per second.
    MinPerSec(f64),
}

impl Goal {
    fn met(self, value: f64) -> bool {
        match self {
            Goal::MaxMs(goal) | Goal::MaxRatio(goal) => value <= goal,
            Goal::MinPerSec(goal) => value >= goal,
        }
    }

    fn render(self, value: f64) -> String {
        match self {
            Goal::MaxMs(_) => format!("{value:.1} ms"),
            Goal::MaxRatio(_) => format!("{value:.2}×"),
            Goal::MinPerSec(_) => format!("{value:.1}/s"),
        }
    }

    fn describe(self) -> String {
        match self {
            Goal::MaxMs(goal) => format!("≤ {goal} ms"),
            Goal::MaxRatio(goal) => format!("≤ {goal}×"),
            Goal::MinPerSec(goal) => format!("≥ {goal}/s"),
        }
    }
}

/// One target and what the run measured for it (`None`: not measured, with why in `note`).
pub struct Target {
    /// What is measured, as the issue words it.
    pub name: String,
    /// The goal.
    pub goal: Goal,
    /// The measured figure in the goal's unit (ms, a ratio, or per second).
    pub measured: Option<f64>,
    /// What the figure is made of, or why it is missing.
    pub note: String,
}

impl Target {
    /// A target with its measured figure (or `None`) and a note.
    pub fn new(
        name: impl Into<String>,
        goal: Goal,
        measured: Option<f64>,
        note: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            goal,
            measured,
            note: note.into(),
        }
    }

    /// `met`, `missed` or `not measured`.
    pub fn status(&self) -> &'static str {
        match self.measured {
            Some(v) if self.goal.met(v) => "met",
            Some(_) => "missed",
            None => "not measured",
        }
    }
}

/// Prints `targets` as one markdown table.
pub fn print(title: &str, targets: &[Target]) {
    println!();
    println!("| {title} | target | measured | status | note |");
    println!("|---|---|---|---|---|");
    for t in targets {
        println!(
            "| {} | {} | {} | {} | {} |",
            t.name,
            t.goal.describe(),
            t.measured
                .map(|v| t.goal.render(v))
                .unwrap_or_else(|| "—".into()),
            t.status(),
            t.note
        );
    }
}

/// `a / b` when both are there and `b` is not zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).filter(|(_, b)| *b > 0.0).map(|(a, b)| a / b)
}

/// Seconds → milliseconds.
pub fn in_ms(seconds: Option<f64>) -> Option<f64> {
    seconds.map(|s| s * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_met_missed_or_not_measured_never_guessed() {
        let at_most = Target::new("x", Goal::MaxMs(25.0), Some(25.0), "");
        assert_eq!(at_most.status(), "met");
        let over = Target::new("x", Goal::MaxMs(25.0), Some(25.1), "");
        assert_eq!(over.status(), "missed");
        let rate = Target::new("x", Goal::MinPerSec(50.0), Some(12.0), "");
        assert_eq!(rate.status(), "missed");
        let missing = Target::new("x", Goal::MaxRatio(1.5), None, "no runsc");
        assert_eq!(missing.status(), "not measured");
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
    }
}
