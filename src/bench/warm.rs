//! How many of a bench phase's creates a warm pool served (issue 16 lever 1): the API's
//! `berth_warm_claims_total{result}` read from the stack's metrics listener (`BERTH_METRICS` in
//! `stack.env`, written by `berth dev --metrics-addr`) before and after the phase.

/// The stack's metrics endpoint, if it serves one.
pub struct WarmClaims {
    url: Option<String>,
}

/// The counter's `(hit, miss)` values at one moment.
pub type Claims = (u64, u64);

impl WarmClaims {
    /// The reader of the stack `lookup` describes.
    pub fn new(lookup: &dyn Fn(&str) -> Option<String>) -> Self {
        Self {
            url: lookup("BERTH_METRICS").map(|base| format!("{base}/metrics")),
        }
    }

    /// The counter now; `None` without a metrics endpoint or when it does not answer.
    pub async fn read(&self) -> Option<Claims> {
        let text = reqwest::get(self.url.as_deref()?)
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        Some(parse(&text))
    }
}

/// `berth_warm_claims_total`'s hit and miss values in a Prometheus text exposition (0 for a
/// series not yet written).
fn parse(text: &str) -> Claims {
    let value = |result: &str| {
        let series = format!("berth_warm_claims_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    (value("hit"), value("miss"))
}

/// `"18 of 20"`: the creates between `before` and `after` that took a warm sandbox, or
/// `"not measured"`.
pub fn served(before: Option<Claims>, after: Option<Claims>) -> String {
    match before.zip(after) {
        Some(((hit0, miss0), (hit1, miss1))) => {
            let hits = hit1.saturating_sub(hit0);
            format!("{hits} of {}", hits + miss1.saturating_sub(miss0))
        }
        None => "not measured".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claims_read_from_an_exposition_and_count_per_phase() {
        let text = "# TYPE berth_warm_claims_total counter\n\
                    berth_warm_claims_total{result=\"hit\"} 7\n\
                    berth_warm_claims_total{result=\"miss\"} 3\n";
        assert_eq!(parse(text), (7, 3));
        assert_eq!(parse("other 1\n"), (0, 0));
        assert_eq!(served(Some((2, 1)), Some((7, 3))), "5 of 7");
        assert_eq!(served(None, Some((7, 3))), "not measured");
    }
}
