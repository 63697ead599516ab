//! Trace context across NATS: the W3C `traceparent` header on every command message, so the
//! spans of one command in api, relay, hostd and reconciler share a trace id.
//!
//! Source: W3C Trace Context, level 1, section 3.2 (`traceparent`:
//! `00-<trace-id: 32 hex>-<parent-id: 16 hex>-<flags: 2 hex>`, lowercase, all-zero ids invalid).
//!
//! The trace id of a command is its [`CommandId`]'s 128 bits, so every component derives the
//! same trace id from the id alone — a span can carry `trace_id` even where no header arrived
//! (a result names its command id), and logs of one command join on it without a tracing
//! backend. The parent id is the publishing span's (random per publish).

use crate::ids::CommandId;

/// The header name (lowercase, as the spec writes it; NATS headers keep case).
pub const TRACEPARENT: &str = "traceparent";
/// The only version this module writes.
const VERSION: &str = "00";
/// Flags: the `sampled` bit.
const SAMPLED: u8 = 0x01;

/// One `traceparent` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The 16-byte trace id (32 hex on the wire); a command's trace id is its `CommandId`.
    pub trace_id: [u8; 16],
    /// The 8-byte id of the publishing span (16 hex on the wire); never all zero.
    pub parent_id: [u8; 8],
    /// The `sampled` flag (bit 0 of the 2-hex flags field).
    pub sampled: bool,
}

impl TraceParent {
    /// The context of `command`'s trace, published by span `parent_id` (never all zero: a zero
    /// id is replaced by 1, which the spec allows as any non-zero value).
    pub fn for_command(command: CommandId, parent_id: [u8; 8]) -> Self {
        let parent_id = if parent_id == [0; 8] {
            1u64.to_be_bytes()
        } else {
            parent_id
        };
        Self {
            trace_id: *command.as_uuid().as_bytes(),
            parent_id,
            sampled: true,
        }
    }

    /// The trace id as 32 lowercase hex digits (what spans record as `trace_id`).
    pub fn trace_id_hex(&self) -> String {
        hex32(&self.trace_id)
    }

    /// The header value.
    pub fn to_header(&self) -> String {
        format!(
            "{VERSION}-{}-{}-{:02x}",
            hex32(&self.trace_id),
            hex32(&self.parent_id),
            if self.sampled { SAMPLED } else { 0 }
        )
    }

    /// The parent id as 16 lowercase hex digits (the publishing span's id).
    pub fn parent_id_hex(&self) -> String {
        hex32(&self.parent_id)
    }

    /// The context a child span with id `span_id` publishes onward: the same trace, with the
    /// child as parent (an all-zero id is replaced by 1, as in [`TraceParent::for_command`]).
    pub fn child(&self, span_id: [u8; 8]) -> Self {
        let parent_id = if span_id == [0; 8] {
            1u64.to_be_bytes()
        } else {
            span_id
        };
        Self { parent_id, ..*self }
    }

    /// Parses a header value; `None` when it is not a valid version-00 `traceparent`.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != VERSION {
            return None;
        }
        let trace_id: [u8; 16] = unhex(trace)?.try_into().ok()?;
        let parent_id: [u8; 8] = unhex(parent)?.try_into().ok()?;
        let flags: [u8; 1] = unhex(flags)?.try_into().ok()?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            parent_id,
            sampled: flags[0] & SAMPLED != 0,
        })
    }
}

fn hex32(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn the_spec_example_parses_and_renders_back() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(v).unwrap();
        assert!(tp.sampled);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.to_header(), v);
    }

    #[test]
    fn a_commands_trace_id_is_its_id() {
        let id = CommandId(Uuid::parse_str("0192f3a4-5b6c-7d8e-9f00-112233445566").unwrap());
        let tp = TraceParent::for_command(id, [0xab; 8]);
        assert_eq!(
            tp.to_header(),
            "00-0192f3a45b6c7d8e9f00112233445566-abababababababab-01"
        );
        assert_eq!(TraceParent::parse(&tp.to_header()), Some(tp));
        assert_ne!(TraceParent::for_command(id, [0; 8]).parent_id, [0; 8]);
    }

    #[test]
    fn a_child_keeps_the_trace_and_names_itself_as_parent() {
        let id = CommandId(Uuid::parse_str("0192f3a4-5b6c-7d8e-9f00-112233445566").unwrap());
        let parent = TraceParent::for_command(id, [0xab; 8]);
        let child = parent.child([0xcd; 8]);
        assert_eq!(child.trace_id, parent.trace_id);
        assert_eq!(child.parent_id_hex(), "cdcdcdcdcdcdcdcd");
        assert_ne!(parent.child([0; 8]).parent_id, [0; 8]);
    }

    #[test]
    fn malformed_or_all_zero_values_are_refused() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
