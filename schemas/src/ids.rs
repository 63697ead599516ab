//! Identifier newtypes. Every ID that crosses a function boundary is one of these, never a bare
//! `Uuid` or `i64` (STYLE.md habit 1).
//!
//! UUIDs are version 7 (time-ordered, RFC 9562), so sorting by ID sorts by creation time; the
//! API's cursor pagination relies on that.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        #[cfg_attr(feature = "db", derive(sqlx::Type), sqlx(transparent))]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new, time-ordered (UUIDv7) identifier.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// The underlying UUID.
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }
    };
}

uuid_id!(
    /// A sandbox: one isolated Linux environment.
    SandboxId
);
uuid_id!(
    /// A host: one machine running `hostd`.
    HostId
);
uuid_id!(
    /// An organization: the tenant that owns sandboxes and API keys.
    OrgId
);
uuid_id!(
    /// A command in the outbox; also the JetStream `Nats-Msg-Id`, so a re-publish is deduplicated.
    CommandId
);
uuid_id!(
    /// A lifecycle event row.
    EventId
);
uuid_id!(
    /// A webhook: an org's HTTP endpoint that receives its events.
    WebhookId
);
uuid_id!(
    /// One event queued for one webhook (its attempts are logged under it).
    DeliveryId
);
uuid_id!(
    /// A snapshot: a sandbox's disk (and, on gVisor, memory) stored in object storage as a
    /// manifest plus content-addressed chunks (`berth-storage`).
    SnapshotId
);
uuid_id!(
    /// An API key row (the key itself is stored only as a SHA-256 hash).
    ApiKeyId
);

/// A sandbox's fencing generation: bumped by every state-changing request. Commands carry it;
/// hostd refuses a command older than the last it applied, and the reconciler applies a result
/// only when it equals the row's current generation (the neon "generation" pattern).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[cfg_attr(feature = "db", derive(sqlx::Type), sqlx(transparent))]
pub struct Generation(pub i64);

impl Generation {
    /// The generation a sandbox is created with.
    pub const INITIAL: Generation = Generation(1);

    /// The next generation.
    pub fn next(self) -> Generation {
        Generation(self.0 + 1)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_their_string_form() {
        let id = SandboxId::new();
        assert_eq!(id.to_string().parse::<SandboxId>().unwrap(), id);
        assert!("not-a-uuid".parse::<SandboxId>().is_err());
    }

    #[test]
    fn later_ids_sort_after_earlier_ones() {
        let a = SandboxId::new();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = SandboxId::new();
        assert!(a < b);
    }

    #[test]
    fn generation_next_increments_by_one() {
        assert_eq!(Generation::INITIAL.next(), Generation(2));
    }
}
