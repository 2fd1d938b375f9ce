//! The Redis key schema (SPEC §6), in one place.
//!
//! Every key of a route starts with `<prefix>:{<route>}:`. The hash tag puts all of a route's
//! keys in one Redis Cluster slot, so a script that touches several of them (the quota's logs,
//! the members' logs, the cooldowns and the pool, in one assignment) runs unchanged on a
//! cluster:
//! - `…:pool` — the least-used sorted set: member = member id, score = assignment count;
//! - `…:q:<window>:<quota key>` — a window of the route's quota: one entry `<seq>:<cost>` per
//!   admitted request, scored by its time in µs;
//! - `…:qm:<quota key>` — the quota key's helper hash (entry sequence, running totals, and
//!   until when each log was last made to live);
//! - `…:mq:<window>:<member>` — a window of a member's own quota, the same log as `…:q:`;
//! - `…:mqm:<member>` — the member quota's helper hash, as `…:qm:`. Member logs have their
//!   own names so that no client-chosen quota key (`key: header:…`) can collide with them;
//! - `<prefix>:{client:<name>}:cq:<window>` and `…:cqm` — a client's own windows and their
//!   helper hash, as `…:q:` and `…:qm:`. They are the client's on every route it uses, so they
//!   have a hash tag (a Redis Cluster slot) of their own: on a single Redis one script decides
//!   them with a route's keys; on a cluster, a call of their own goes first;
//! - `<prefix>:{client:<name>}:cl` — the leases of a client with a `max_in_flight`: a sorted
//!   set, member = lease id, score = the time in µs when it expires. In the client's hash tag,
//!   as its windows, and kept as long as its longest lease and a minute more;
//! - `…:cool` — the cooldowns: a sorted set, member = member id, score = the time in µs (Redis
//!   `TIME`) until which it cools. Entries past are trimmed when a member is cooled, and the key
//!   expires with its longest cooldown.
//!
//! Every key expires on its own once idle, except the pool, which holds the configured members.
//!
//! A route with `state_shards: S` above 1 keeps S sub-logs, each a whole set of the keys above
//! under a name of its own ([`sub_log`]): sub-log 0 is the route's own name (its keys are
//! exactly those of a route without sub-logs), sub-log i ≥ 1 is `<route>#<i><suffix>`, whose
//! three-character suffix puts its hash tag on the slot `S` evenly spaced slots away from the
//! route's own (the [`suffixes`] table). Every instance computes the same names from the
//! config alone.

use std::sync::OnceLock;

/// Redis Cluster's slots.
pub const SLOTS: u16 = 16384;

/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes a key's tag with.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The Redis Cluster slot of a hash tag (what a key holds between its first `{` and `}`).
pub fn slot(tag: &[u8]) -> u16 {
    crc16(tag) % SLOTS
}

/// The characters a suffix is made of: letters and digits, nothing a key or a log would
/// quote.
const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// Per slot, a three-character suffix whose own slot is that one: the first such in
/// [`ALPHABET`] order, so the table is the same on every instance and in every version.
/// Three characters reach every slot (a unit test proves it).
pub fn suffixes() -> &'static [[u8; 3]] {
    static TABLE: OnceLock<Vec<[u8; 3]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = vec![[0u8; 3]; usize::from(SLOTS)];
        let mut filled = vec![false; usize::from(SLOTS)];
        for &a in ALPHABET {
            for &b in ALPHABET {
                for &c in ALPHABET {
                    let s = usize::from(slot(&[a, b, c]));
                    if !filled[s] {
                        filled[s] = true;
                        table[s] = [a, b, c];
                    }
                }
            }
        }
        table
    })
}

/// The name sub-log `i` of `shards` of `route` goes by in its keys (in place of the route's
/// name). Sub-log 0 is the route's own name. Sub-log i ≥ 1 is `<route>#<i>` and a suffix
/// from [`suffixes`] that puts it on slot (slot of `route` + i·⌊16384/shards⌋) mod 16384:
/// evenly spaced slots, which land on distinct masters when the masters own equal contiguous
/// ranges, as `redis-cli --cluster create` assigns them. With CRC16's zero start, the
/// checksum of `base ‖ suffix` is that of `base ‖ 000` xor that of the suffix, so the suffix
/// needed is the table's entry for the target slot xor the slot of `base ‖ 000`. Route names
/// are `[A-Za-z0-9_-]`: no other route's sub-log has the same name.
pub fn sub_log(route: &str, i: u32, shards: u32) -> String {
    if i == 0 || shards <= 1 {
        return route.to_string();
    }
    let step = u32::from(SLOTS) / shards;
    let target = ((u32::from(slot(route.as_bytes())) + i * step) % u32::from(SLOTS)) as u16;
    let mut name = format!("{route}#{i}");
    let mut padded = name.clone().into_bytes();
    padded.extend_from_slice(&[0, 0, 0]);
    let from_base = crc16(&padded) % SLOTS;
    let suffix = suffixes()[usize::from(target ^ from_base)];
    name.extend(suffix.iter().map(|&b| char::from(b)));
    name
}

/// Names the keys of every route under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (`state.redis.key_prefix`).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_string(),
        }
    }

    /// The least-used pool of `route`.
    pub fn pool(&self, route: &str) -> String {
        self.pool_parts(route).concat()
    }

    /// The helper hash of one quota key.
    pub fn quota_meta(&self, route: &str, key: &str) -> String {
        self.quota_meta_parts(route, key).concat()
    }

    /// The log of one window of one quota key.
    pub fn quota_log(&self, route: &str, window: &str, key: &str) -> String {
        self.quota_log_parts(route, window, key).concat()
    }

    /// The helper hash of one member's own quota.
    pub fn member_meta(&self, route: &str, member: &str) -> String {
        self.member_meta_parts(route, member).concat()
    }

    /// The log of one window of one member's own quota.
    pub fn member_log(&self, route: &str, window: &str, member: &str) -> String {
        self.member_log_parts(route, window, member).concat()
    }

    /// The cooldowns of the members of `route`.
    pub fn cooldowns(&self, route: &str) -> String {
        self.cooldowns_parts(route).concat()
    }

    /// The helper hash of a client's own windows.
    pub fn client_meta(&self, client: &str) -> String {
        self.client_meta_parts(client).concat()
    }

    /// The log of one of a client's own windows.
    pub fn client_log(&self, client: &str, window: &str) -> String {
        self.client_log_parts(client, window).concat()
    }

    // The same names as pieces, for a request's script call to write them straight into its
    // command (`ScriptCall::key`) rather than allocate each one. Each layout is defined here
    // only: the `String` forms above are these, concatenated.

    pub(crate) fn pool_parts<'a>(&'a self, route: &'a str) -> [&'a str; 4] {
        [&self.prefix, ":{", route, "}:pool"]
    }

    pub(crate) fn quota_meta_parts<'a>(&'a self, route: &'a str, key: &'a str) -> [&'a str; 5] {
        [&self.prefix, ":{", route, "}:qm:", key]
    }

    pub(crate) fn quota_log_parts<'a>(
        &'a self,
        route: &'a str,
        window: &'a str,
        key: &'a str,
    ) -> [&'a str; 7] {
        [&self.prefix, ":{", route, "}:q:", window, ":", key]
    }

    pub(crate) fn member_meta_parts<'a>(&'a self, route: &'a str, member: &'a str) -> [&'a str; 5] {
        [&self.prefix, ":{", route, "}:mqm:", member]
    }

    pub(crate) fn member_log_parts<'a>(
        &'a self,
        route: &'a str,
        window: &'a str,
        member: &'a str,
    ) -> [&'a str; 7] {
        [&self.prefix, ":{", route, "}:mq:", window, ":", member]
    }

    pub(crate) fn cooldowns_parts<'a>(&'a self, route: &'a str) -> [&'a str; 4] {
        [&self.prefix, ":{", route, "}:cool"]
    }

    /// A route's leases (`lua/leases.lua`): expiries (`lz`), lease → member (`lh`), member →
    /// leases in flight (`lc`).
    pub(crate) fn lease_parts<'a>(&'a self, route: &'a str, which: &'a str) -> [&'a str; 4] {
        [&self.prefix, ":{", route, which]
    }

    pub(crate) fn client_meta_parts<'a>(&'a self, client: &'a str) -> [&'a str; 4] {
        [&self.prefix, ":{client:", client, "}:cqm"]
    }

    pub(crate) fn client_leases_parts<'a>(&'a self, client: &'a str) -> [&'a str; 4] {
        [&self.prefix, ":{client:", client, "}:cl"]
    }

    pub(crate) fn client_log_parts<'a>(&'a self, client: &'a str, window: &'a str) -> [&'a str; 5] {
        [&self.prefix, ":{client:", client, "}:cq:", window]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_limiter::Window;

    #[test]
    fn every_key_of_a_route_shares_its_hash_tag() {
        let keys = Keys::new("sluice");
        let w = [Window {
            name: "burst".into(),
            limit: 1,
            length_us: 1,
        }];
        let all = [
            keys.quota_meta("api", "tenant-a"),
            keys.quota_log("api", &w[0].name, "tenant-a"),
            keys.pool("api"),
            keys.member_meta("api", "key-a"),
            keys.member_log("api", "rpm", "key-a"),
            keys.cooldowns("api"),
        ];
        assert_eq!(
            all,
            [
                "sluice:{api}:qm:tenant-a",
                "sluice:{api}:q:burst:tenant-a",
                "sluice:{api}:pool",
                "sluice:{api}:mqm:key-a",
                "sluice:{api}:mq:rpm:key-a",
                "sluice:{api}:cool"
            ]
        );
    }

    #[test]
    fn every_suffix_hashes_to_its_slot() {
        let table = suffixes();
        assert_eq!(table.len(), usize::from(SLOTS));
        for (s, suffix) in table.iter().enumerate() {
            assert!(
                suffix.iter().all(|b| ALPHABET.contains(b)),
                "slot {s} has no suffix"
            );
            assert_eq!(
                usize::from(slot(suffix)),
                s,
                "{:?}",
                std::str::from_utf8(suffix)
            );
        }
        // The checksum Redis documents for its Cluster.
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    /// The slot of each sub-log's tag is its target, for routes of every length; sub-log 0 is
    /// the route itself, so one sub-log changes no key.
    #[test]
    fn sub_logs_land_on_evenly_spaced_slots() {
        for route in [
            "a",
            "api",
            "openai-chat_v2",
            "r7",
            "a-route-with-a-rather-long-name",
        ] {
            let base = slot(route.as_bytes());
            assert_eq!(sub_log(route, 0, 1), route);
            assert_eq!(sub_log(route, 0, 3), route);
            for shards in 2..=16u32 {
                let mut names = std::collections::HashSet::new();
                for i in 0..shards {
                    let name = sub_log(route, i, shards);
                    let want = (u32::from(base) + i * (16384 / shards)) % 16384;
                    assert_eq!(u32::from(slot(name.as_bytes())), want, "{name}");
                    assert!(names.insert(name));
                }
            }
        }
        assert_eq!(
            Keys::new("sluice").pool(&sub_log("api", 0, 3)),
            "sluice:{api}:pool"
        );
        // The names are the same in every version (operations.md shows one): a table that
        // changed would move every sub-log's keys.
        assert_eq!(sub_log("api", 1, 3), "api#1ACO");
        assert_eq!(sub_log("api", 2, 3), "api#2BUC");
    }

    /// With three masters as `redis-cli --cluster create` assigns them (0-5460, 5461-10922,
    /// 10923-16383), three sub-logs sit on three masters for every route but those whose own
    /// slot is 0 or 5461 (the spacing falls on a boundary there).
    #[test]
    fn three_sub_logs_land_on_three_masters_of_a_created_cluster() {
        let master = |s: u16| match s {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        };
        let mut missed = Vec::new();
        for i in 0..2000 {
            let route = format!("r{i}");
            let masters: std::collections::HashSet<_> = (0..3)
                .map(|j| master(slot(sub_log(&route, j, 3).as_bytes())))
                .collect();
            if masters.len() != 3 {
                missed.push(slot(route.as_bytes()));
            }
        }
        assert!(missed.iter().all(|s| [0, 5461].contains(s)), "{missed:?}");
        let all_slots = (0..SLOTS)
            .filter(|&s| {
                let step = SLOTS / 3;
                let m: std::collections::HashSet<_> =
                    (0..3).map(|j| master((s + j * step) % SLOTS)).collect();
                m.len() != 3
            })
            .collect::<Vec<_>>();
        assert_eq!(all_slots, [0, 5461]);
    }

    /// A client's windows are its own on every route: their keys share one hash tag, the
    /// client's, and none of a route's (whatever the route is named), so that on a single
    /// Redis one script decides them with any route's keys, and on a cluster they stay in one
    /// slot.
    #[test]
    fn a_clients_keys_share_a_hash_tag_of_their_own() {
        let keys = Keys::new("sluice");
        assert_eq!(keys.client_meta("billing"), "sluice:{client:billing}:cqm");
        assert_eq!(
            keys.client_log("billing", "daily"),
            "sluice:{client:billing}:cq:daily"
        );
        // A route named like the client's tag still has keys of other names.
        assert_ne!(
            keys.quota_meta("client:billing", "x"),
            keys.client_meta("billing")
        );
        assert!(!keys.pool("client:billing").ends_with(":cqm"));
    }
}
