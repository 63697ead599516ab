//! How the CLI prints: aligned tables and key/value views for people, JSON for programs, and
//! spinners on stderr (drawn only when stderr is a terminal).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

/// How often a spinner moves.
const SPINNER_TICK: Duration = Duration::from_millis(100);

/// Columns with a two-space gutter, each as wide as its widest cell (the last one unpadded).
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, cell) in cells.into_iter().enumerate() {
            out.push_str(cell);
            if i < last {
                let pad = widths[i] - cell.chars().count() + 2;
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// `value` pretty-printed, with a final newline.
pub fn json(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("a JSON value serializes");
    text.push('\n');
    text
}

/// A cell: a string as is, null as `-`, anything else as JSON.
pub fn cell(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The columns of `berth sandbox ls`.
pub const SANDBOX_COLUMNS: [&str; 6] = ["ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "CREATED"];

/// A sandbox as a row of [`SANDBOX_COLUMNS`].
pub fn sandbox_row(s: &Value) -> Vec<String> {
    vec![
        cell(&s["id"]),
        cell(&s["state"]),
        cell(&s["template"]),
        cell(&s["vcpus"]),
        format!("{} MiB", cell(&s["memory_mib"])),
        cell(&s["created_at"]),
    ]
}

/// A sandbox as `key: value` lines (the fields people look for; `--json` has them all).
pub fn sandbox_detail(s: &Value) -> String {
    let fields = [
        "id",
        "state",
        "state_reason",
        "template",
        "vcpus",
        "memory_mib",
        "disk_mib",
        "address",
        "host_id",
        "last_stop",
        "last_stop_reason",
        "auto_stop_minutes",
        "auto_delete_minutes",
        "auto_archive_days",
        "durable_at",
        "backup_interval_min",
        "last_backup_id",
        "last_backup_at",
        "auto_resume",
        "public_ports",
        "expires_at",
        "metadata",
        "created_at",
        "updated_at",
    ];
    let rows: Vec<Vec<String>> = fields
        .iter()
        .filter(|f| !s[**f].is_null())
        .map(|f| vec![format!("{f}:"), cell(&s[*f])])
        .collect();
    let mut out = String::new();
    let width = rows.iter().map(|r| r[0].len()).max().unwrap_or(0);
    for row in rows {
        out.push_str(&format!("{:width$} {}\n", row[0], row[1]));
    }
    out
}

/// A spinner on stderr saying `message` (hidden when stderr is not a terminal).
pub fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("a valid template"),
    );
    bar.set_message(message);
    bar.enable_steady_tick(SPINNER_TICK);
    bar
}

/// A progress bar of `total` bytes on stderr (a byte counter when the total is unknown).
pub fn bytes_bar(total: Option<u64>, message: String) -> ProgressBar {
    let bar = match total {
        Some(total) => {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar
        }
        None => {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {msg} {bytes} {bytes_per_sec}")
                    .expect("a valid template"),
            );
            bar
        }
    };
    bar.set_message(message);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_aligns_its_columns() {
        let out = table(
            &["ID", "STATE"],
            &[
                vec!["a".into(), "running".into()],
                vec!["long-id".into(), "-".into()],
            ],
        );
        assert_eq!(out, "ID       STATE\na        running\nlong-id  -\n");
    }
}
