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
