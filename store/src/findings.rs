//! Inventory findings (`inventory_findings`, migration 0042): what each host's newest inventory
//! disagrees with, judged once when its heartbeat is ingested, so the reconciler's pass reads a
//! handful of indexed rows instead of expanding every host's inventory (100,000 items at 1,000
//! hosts) from `jsonb` and joining it with the sandbox rows in every pass (issue 16).
//!
//! # What is found
//! In the statement that stores a host's inventory ([`crate::heartbeats::upsert`]), against the
//! sandbox rows as that statement sees them:
//! - **unlisted**: each `running` sandbox placed on the host (not being deleted) that the
//!   inventory does not list `running` — a guest the pass may fail
//!   ([`crate::sandboxes::guest_tallies`], [`crate::sandboxes::lock_failed_guests`]);
//! - **unwanted**: each container the inventory lists `running` or `unhealthy` whose row is
//!   missing, names another host, or is in [`UNWANTED_RUNNING_ON_ITS_HOST`] — one the pass may
//!   stop or destroy ([`crate::hosts::unwanted_containers`]).
//!
//! # Guarantees
//! - A finding belongs to one inventory: it carries the heartbeat's `seq`, and the pass reads
//!   only findings whose `seq` is the host's current `heartbeat_seq` ([`CURRENT_SQL`]). The
//!   findings are written by the statement that writes that `seq`, so the pass never reads an
//!   inventory without its findings, nor findings of an inventory that was replaced.
//! - The pass decides on the current rows, exactly as it did on the whole inventory: a finding
//!   only names a candidate, and every condition (state, placement, grace after the row's last
//!   change, the host's evidence age, the host having applied every command) is checked again.
//! - Nothing the pass would have judged is missed: a row that changes after the ingest has an
//!   `updated_at` after the inventory was taken, and an inventory is evidence about a row only
//!   when it was taken after the row's last change (plus the grace). The one exception is a
//!   row written by a transaction that began before the inventory was taken (by more than the
//!   grace) and committed after the ingest read the rows: the next heartbeat's ingest, seconds
//!   later, finds it.
//! - Reading the rows takes no lock: ingest never waits on a sandbox's transaction.
//!
//! # Cost
//! Per host and heartbeat: one index scan of its running sandboxes (`sandboxes_running_on_host`,
//! about 100 entries), a hash join with its items, and a primary-key lookup only for the items
//! that are not one of those rows (a stray, a boot not yet applied, a sandbox being stopped).

use berth_schemas::state::UNWANTED_RUNNING_ON_ITS_HOST;
use berth_schemas::wire::GuestStatus;
use berth_schemas::SandboxState;

/// The SQL condition (finding alias `f`, host alias `h`) that a finding belongs to the host's
/// current inventory.
pub const CURRENT_SQL: &str = "f.seq = h.heartbeat_seq";

/// `('a', 'b', …)`: a list of SQL literals of our own constants (never user input).
fn literals<'a>(values: impl IntoIterator<Item = &'a str>) -> String {
    let quoted: Vec<String> = values.into_iter().map(|v| format!("'{v}'")).collect();
    format!("({})", quoted.join(", "))
}

/// The statuses of a container that runs (`running`, `unhealthy`): the ones no row may lack.
pub(crate) fn live_statuses() -> [&'static str; 2] {
    [
        GuestStatus::Running.as_str(),
        GuestStatus::Unhealthy.as_str(),
    ]
}

/// The common table expressions that judge the inventories just stored and rewrite their hosts'
/// findings. They follow `WITH up AS (… RETURNING id, seq …)` — the hosts whose heartbeat was
/// applied, with its `seq` — and read the applied heartbeats' items from four parallel arrays:
/// `$15` host ids (`uuid[]`), `$16` sandbox ids (`uuid[]`), `$17` generations (`int8[]`), `$18`
/// statuses (`text[]`).
///
/// The running rows are read per applied host through `sandboxes_running_on_host` (`LATERAL …
/// OFFSET 0` keeps that a per-host index scan: the arrays' row estimates are guesses), and only
/// the live items that are none of them are looked up by primary key (`unmatched`, materialized
/// first; `OFFSET 0` keeps the lookup a per-item probe rather than a hash anti-join over every
/// sandbox when the estimate of `unmatched` is off). The previous findings of each applied host that are not found again are deleted and
/// the rest written, in this statement.
pub(crate) fn judge_inventories_sql() -> String {
    let running = SandboxState::Running.as_str();
    format!(
        ",
        items AS (
          SELECT i.host_id, i.sandbox_id, i.generation, i.status, up.seq
            FROM UNNEST($15::uuid[], $16::uuid[], $17::int8[], $18::text[])
                 AS i(host_id, sandbox_id, generation, status)
            JOIN up ON up.id = i.host_id),
        running AS (
          SELECT up.id AS host_id, r.id, up.seq
            FROM up CROSS JOIN LATERAL (
                 SELECT s.id FROM sandboxes s
                  WHERE s.host_id = up.id AND s.state = '{running}' AND s.deleted_at IS NULL
                 OFFSET 0) r),
        unmatched AS MATERIALIZED (
          SELECT i.* FROM items i
           WHERE i.status IN {live}
             AND NOT EXISTS (SELECT 1 FROM running r
                              WHERE r.host_id = i.host_id AND r.id = i.sandbox_id)),
        found AS (
          SELECT DISTINCT ON (host_id, sandbox_id) * FROM (
            SELECT u.host_id, u.sandbox_id, u.seq, false AS unlisted, u.generation, u.status
              FROM unmatched u
             WHERE NOT EXISTS (SELECT 1 FROM sandboxes s
                                WHERE s.id = u.sandbox_id AND s.host_id = u.host_id
                                  AND s.state NOT IN {unwanted}
                               OFFSET 0)
            UNION ALL
            SELECT r.host_id, r.id, r.seq, true, i.generation, i.status
              FROM running r
              LEFT JOIN items i ON i.host_id = r.host_id AND i.sandbox_id = r.id
             WHERE NOT EXISTS (SELECT 1 FROM items j
                                WHERE j.host_id = r.host_id AND j.sandbox_id = r.id
                                  AND j.status = '{running}')) f
          -- Of an item listed twice, the newest generation (a compensation's fence).
          ORDER BY host_id, sandbox_id, generation DESC NULLS LAST),
        cleared AS (
          DELETE FROM inventory_findings f USING up
           WHERE f.host_id = up.id
             AND NOT EXISTS (SELECT 1 FROM found n
                              WHERE n.host_id = f.host_id AND n.sandbox_id = f.sandbox_id)),
        written AS (
          INSERT INTO inventory_findings (host_id, sandbox_id, seq, unlisted, generation, status)
          SELECT host_id, sandbox_id, seq, unlisted, generation, status FROM found
          ON CONFLICT (host_id, sandbox_id) DO UPDATE
             SET seq = EXCLUDED.seq, unlisted = EXCLUDED.unlisted,
                 generation = EXCLUDED.generation, status = EXCLUDED.status)",
        live = literals(live_statuses()),
        unwanted = literals(UNWANTED_RUNNING_ON_ITS_HOST.iter().map(|s| s.as_str())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_row_on_its_host_is_never_unwanted_there() {
        // The ingest skips the lookup of a live item that is one of the host's running rows.
        assert!(!UNWANTED_RUNNING_ON_ITS_HOST.contains(&SandboxState::Running));
    }

    #[test]
    fn literals_quote_each_value() {
        assert_eq!(literals(["a", "b-c"]), "('a', 'b-c')");
    }
}
