//! Sticky bindings in process: session → member, for a single instance. The same rules as
//! `lua/sticky.lua`. Part of [`crate::MemoryStore`], under the route's lock.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::{StickyCounts, BINDINGS_EXPIRED_PER_CALL};

/// One route's bindings, at most the `max_bindings` of the asks that add them.
#[derive(Debug, Default)]
pub(crate) struct Bindings {
    /// Session hash → its member and expiry (µs).
    by_session: HashMap<Box<str>, (Arc<str>, u64)>,
    /// (expiry, session hash), soonest first.
    expiries: BTreeSet<(u64, Box<str>)>,
    unbound: u64,
    moved: u64,
}

impl Bindings {
    /// Drops at most [`BINDINGS_EXPIRED_PER_CALL`] bindings whose expiry is not after `now`,
    /// as Redis does: the work of one call stays bounded however many expired at once.
    pub(crate) fn expire(&mut self, now: u64) {
        for _ in 0..BINDINGS_EXPIRED_PER_CALL {
            match self.expiries.first() {
                Some(first) if first.0 <= now => {}
                _ => return,
            }
            if let Some((_, session)) = self.expiries.pop_first() {
                self.by_session.remove(&session);
            }
        }
    }

    /// The member `session` is bound to at `now`, if any (an expired binding not yet dropped is
    /// not followed).
    pub(crate) fn bound(&self, session: &str, now: u64) -> Option<Arc<str>> {
        self.by_session
            .get(session)
            .filter(|(_, expiry)| *expiry > now)
            .map(|(member, _)| member.clone())
    }

    /// Binds `session` to `member` until `expiry`: a binding already held moves (counted when
    /// its member changes), a new one is added only while the table holds fewer than `max`
    /// (else counted as unbound).
    pub(crate) fn bind(&mut self, session: &str, member: &Arc<str>, expiry: u64, max: u64) {
        let full = self.by_session.len() as u64 >= max;
        match self.by_session.get_mut(session) {
            Some((was, at)) => {
                if *was != *member {
                    self.moved += 1;
                    *was = member.clone();
                }
                let old = (*at, Box::<str>::from(session));
                *at = expiry;
                self.expiries.remove(&old);
                self.expiries.insert((expiry, session.into()));
            }
            None if !full => {
                self.by_session
                    .insert(session.into(), (member.clone(), expiry));
                self.expiries.insert((expiry, session.into()));
            }
            None => self.unbound += 1,
        }
    }

    /// Drops the binding of `session` if it points to `member`.
    pub(crate) fn unbind(&mut self, session: &str, member: &str) {
        if let Some((was, expiry)) = self.by_session.get(session) {
            if **was == *member {
                let key = (*expiry, Box::<str>::from(session));
                self.expiries.remove(&key);
                self.by_session.remove(session);
                self.moved += 1;
            }
        }
    }

    pub(crate) fn counts(&self) -> StickyCounts {
        StickyCounts {
            bindings: self.by_session.len() as u64,
            unbound: self.unbound,
            moved: self.moved,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_binds_no_new_session_but_moves_and_renews_old_ones() {
        let mut b = Bindings::default();
        let (a, c): (Arc<str>, Arc<str>) = ("a".into(), "c".into());
        b.bind("s1", &a, 100, 1);
        b.bind("s2", &a, 100, 1);
        assert_eq!(b.bound("s2", 0), None);
        b.bind("s1", &c, 200, 1);
        assert_eq!(b.bound("s1", 150), Some(c.clone()));
        assert_eq!(
            b.counts(),
            StickyCounts {
                bindings: 1,
                unbound: 1,
                moved: 1
            }
        );
        b.unbind("s1", "a");
        assert_eq!(b.bound("s1", 0), Some(c));
        b.unbind("s1", "c");
        assert_eq!(b.bound("s1", 0), None);
    }

    #[test]
    fn expired_bindings_are_not_followed_and_go_in_bounded_steps() {
        let mut b = Bindings::default();
        let a: Arc<str> = "a".into();
        let n = BINDINGS_EXPIRED_PER_CALL as u64 + 10;
        for i in 0..n {
            b.bind(&format!("s{i}"), &a, 10, u64::MAX);
        }
        assert_eq!(b.bound("s0", 10), None);
        b.expire(10);
        assert_eq!(b.counts().bindings, 10);
        b.expire(10);
        assert_eq!(b.counts().bindings, 0);
    }
}
