//! The Lua scripts in `lua/`, and the protocol the Redis backend speaks with them: how each
//! script is assembled from its libraries, and how replies are read (how arguments are laid
//! out is `call.rs`'s, which writes them).
//!
//! The libraries (`quota.lua` from `sluice-limiter`, `allocator.lua` and `members.lua` from
//! `sluice-allocator`) define functions; each driver (`*_run.lua`) is the body of one
//! operation, so one call composes several policies atomically. The same files are sent two ways:
//! - as one Redis function library (Redis 7 `FUNCTION LOAD`), called with `FCALL`. Its
//!   functions are created once, when it is loaded;
//! - as scripts for `EVALSHA`: each driver appended to the libraries it uses. Redis runs a
//!   script's whole text on every call, so every library function is created again each time
//!   (18k of a key-pool call's 188k redis-server instructions, `scripts/redis-script-cost
//!   --fcall`). This is what Redis 6, or a user whose ACL denies `FUNCTION`, gets.
//!
//! Replies are checked, never trusted: a reply of the wrong shape (another program's script
//! under our SHA, a Redis proxy that mangles arrays) is a [`StoreError`], not a panic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use redis::{Script, Value};

use sluice_allocator::lua::{
    ALLOCATOR_DRIVER, ALLOCATOR_LIBRARY, ASSIGN_DRIVER, COOL_DRIVER, FUSED_DRIVER, LEASES_LIBRARY,
    LEASE_DRIVER, MEMBERS_LIBRARY, STICKY_DRIVER, STICKY_LIBRARY,
};
use sluice_allocator::{Assignment, Reserved};
use sluice_limiter::lua::{
    CLIENT_DRIVER, DRIVER as QUOTA_DRIVER, LIBRARY as QUOTA_LIBRARY, USAGE_DRIVER,
};
use sluice_limiter::{
    EntryId, Outcome, Reservation, Settled, StoreError, WindowState, WindowUsage,
};

/// One operation: its function in the library, and the same code as a script for `EVALSHA`.
pub struct StateScript {
    pub(crate) function: String,
    pub(crate) eval: Script,
}

/// sluice's function library, and whether this Redis takes it.
///
/// Its name ends with a hash of its text, and so do its functions' names (Redis has one
/// namespace of function names): during a rolling upgrade each version loads and calls its own
/// library, and neither replaces the other's code. A library stays in Redis (it is persisted
/// and replicated like data) until `FUNCTION DELETE`; docs/operations.md says how to remove old ones.
pub struct Library {
    pub(crate) name: String,
    pub(crate) source: String,
    /// Cleared, for good, when Redis refuses functions (Redis 6 has no `FCALL`; an ACL may deny
    /// it): every call then goes by `EVALSHA`.
    functions: AtomicBool,
    /// How many times this store loaded the library, and the lock one load at a time holds.
    /// When Redis has lost the library (a restart without persistence, `FUNCTION FLUSH`, a new
    /// node), every call in flight finds its function missing at once: each loading the ~90 KB
    /// library on its own made hundreds of loads on every master, each a millisecond or two of
    /// Redis, and a burst of first calls outlasted its timeout. The first to take the lock
    /// loads; the others wait for it and see the count moved, and send their call again.
    pub(crate) loads: AtomicU64,
    pub(crate) loading: tokio::sync::Mutex<()>,
}

impl Library {
    /// Whether calls go by `FCALL`.
    pub fn functions(&self) -> bool {
        self.functions.load(Ordering::Relaxed)
    }

    pub(crate) fn refuse_functions(&self) {
        self.functions.store(false, Ordering::Relaxed);
    }
}

/// The scripts a Redis store runs.
pub struct Scripts {
    /// Every operation below, as one function library.
    pub library: Library,
    /// One or more requests against one quota key (batch.rs).
    pub quota: StateScript,
    /// One request against its route's quota and its client's own windows together; on Redis
    /// Cluster, the client's windows alone, and the give-back of their charge.
    pub client: StateScript,
    /// Least-used `assign` (one or more requests, batch.rs), `sync` and `restore` on one pool.
    pub allocator: StateScript,
    /// Quota and least-used assignment in one atomic call, for one or more requests of one
    /// route and quota key (batch.rs).
    pub fused: StateScript,
    /// An assignment with member windows, cooldowns or a preference order (and the route's
    /// quota): the general case, kept apart so that a plain least-used route runs fewer
    /// commands.
    pub assign: StateScript,
    /// Cooling a member, and listing the cooling members.
    pub cool: StateScript,
    /// A reservation whose windows each take their own amount, and batched settlements.
    pub usage: StateScript,
    /// Releasing, renewing and reading a route's leases.
    pub lease: StateScript,
    /// Unbinding a sticky session, and reading a route's bindings.
    pub sticky: StateScript,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts::new()
    }
}

/// The operations, by their function's suffix, with their drivers.
const OPERATIONS: [(&str, &str); 9] = [
    ("quota", QUOTA_DRIVER),
    ("client", CLIENT_DRIVER),
    ("allocator", ALLOCATOR_DRIVER),
    ("fused", FUSED_DRIVER),
    ("assign", ASSIGN_DRIVER),
    ("cool", COOL_DRIVER),
    ("usage", USAGE_DRIVER),
    ("lease", LEASE_DRIVER),
    ("sticky", STICKY_DRIVER),
];

/// Stands for the library's name in its text until the text's hash gives it one.
const NAME: &str = "@LIBRARY@";

/// The library's text, every name in it still `NAME`. A library may not assign globals, so
/// `KEYS` and `ARGV` are the library's own locals, set by each entry point, and each driver
/// becomes a function. The quota library's clock is per call: it is cleared on entry, since a
/// library's locals outlive the call (a script's do not).
fn library_template() -> String {
    let mut text = format!(
        "#!lua name={NAME}\n\
         -- sluice's state operations, written by crates/store/src/scripts.rs from lua/.\n\
         local KEYS, ARGV\n\
         {QUOTA_LIBRARY}\n{ALLOCATOR_LIBRARY}\n{MEMBERS_LIBRARY}\n{LEASES_LIBRARY}\n{STICKY_LIBRARY}\n"
    );
    for (op, driver) in OPERATIONS {
        text.push_str(&format!("local function run_{op}()\n{driver}\nend\n"));
    }
    text.push_str(
        "local function entry(run)
  return function(keys, args)
    KEYS, ARGV = keys, args
    quota_redis_now, quota_now_text = nil, nil
    return run()
  end
end
",
    );
    for (op, _) in OPERATIONS {
        text.push_str(&format!(
            "redis.register_function('{NAME}_{op}', entry(run_{op}))\n"
        ));
    }
    text
}

impl Scripts {
    /// Assembles every script and the library. Their hashes are computed over these exact
    /// bytes.
    pub fn new() -> Scripts {
        let template = library_template();
        let name = format!("sluice_{}", &Script::new(&template).get_hash()[..16]);
        let op = |suffix: &str, eval: String| StateScript {
            function: format!("{name}_{suffix}"),
            eval: Script::new(&eval),
        };
        Scripts {
            quota: op("quota", quota_source()),
            client: op("client", format!("{QUOTA_LIBRARY}\n{CLIENT_DRIVER}")),
            allocator: op(
                "allocator",
                format!("{ALLOCATOR_LIBRARY}\n{ALLOCATOR_DRIVER}"),
            ),
            fused: op(
                "fused",
                format!("{QUOTA_LIBRARY}\n{ALLOCATOR_LIBRARY}\n{FUSED_DRIVER}"),
            ),
            // The driver decides several requests in one call by giving each its own KEYS and
            // ARGV in turn; a script's globals are read-only, so those are the script's locals.
            assign: op(
                "assign",
                format!(
                    "local KEYS, ARGV = KEYS, ARGV\n{QUOTA_LIBRARY}\n{ALLOCATOR_LIBRARY}\n{MEMBERS_LIBRARY}\n{LEASES_LIBRARY}\n{STICKY_LIBRARY}\n{ASSIGN_DRIVER}"
                ),
            ),
            cool: op(
                "cool",
                format!("{QUOTA_LIBRARY}\n{ALLOCATOR_LIBRARY}\n{MEMBERS_LIBRARY}\n{COOL_DRIVER}"),
            ),
            usage: op("usage", format!("{QUOTA_LIBRARY}\n{USAGE_DRIVER}")),
            lease: op(
                "lease",
                format!(
                    "{QUOTA_LIBRARY}\n{ALLOCATOR_LIBRARY}\n{MEMBERS_LIBRARY}\n{LEASES_LIBRARY}\n{LEASE_DRIVER}"
                ),
            ),
            sticky: op(
                "sticky",
                format!("{QUOTA_LIBRARY}\n{STICKY_LIBRARY}\n{STICKY_DRIVER}"),
            ),
            library: Library {
                source: template.replace(NAME, &name),
                name,
                functions: AtomicBool::new(true),
                loads: AtomicU64::new(0),
                loading: tokio::sync::Mutex::new(()),
            },
        }
    }
}

/// The source of the quota script: the library followed by its driver.
pub fn quota_source() -> String {
    format!("{QUOTA_LIBRARY}\n{QUOTA_DRIVER}")
}

/// Parses `{admitted, retry_after_us, remaining_i, reset_us_i...}` as the quota library replies.
pub fn parse_quota(reply: &[i64], windows: usize) -> Result<Outcome, StoreError> {
    if reply.len() != 2 + 2 * windows {
        return Err(StoreError::Backend(format!(
            "quota script returned {} values, expected {}",
            reply.len(),
            2 + 2 * windows
        )));
    }
    let non_negative = |v: i64| v.max(0) as u64;
    Ok(Outcome {
        admitted: reply[0] == 1,
        retry_after_us: non_negative(reply[1]),
        windows: reply[2..]
            .chunks_exact(2)
            .map(|c| WindowState {
                remaining: non_negative(c[0]),
                reset_us: non_negative(c[1]),
            })
            .collect(),
    })
}

/// `{admitted, retry_after_us, remaining_i, reset_us_i..., seq, at_us}` (`usage_run.lua`'s
/// "reserve") → the reservation over `windows` windows, with its entry when admitted.
pub fn parse_reservation(reply: &[i64], windows: usize) -> Result<Reservation, StoreError> {
    let Some((ids, decision)) = reply
        .len()
        .checked_sub(2)
        .map(|at| (&reply[at..], &reply[..at]))
    else {
        return Err(StoreError::Backend(format!(
            "usage script returned {} values",
            reply.len()
        )));
    };
    let outcome = parse_quota(decision, windows)?;
    let entry = match (outcome.admitted, ids[0], ids[1]) {
        (true, seq, at_us) if seq > 0 && at_us >= 0 => Some(EntryId {
            seq: seq as u64,
            at_us: at_us as u64,
        }),
        (false, 0, 0) => None,
        _ => {
            return Err(StoreError::Backend(format!(
                "usage script returned the entry {ids:?} for admitted = {}",
                outcome.admitted
            )))
        }
    };
    Ok(Reservation { outcome, entry })
}

/// The assign script's reply when it reserves usage: as [`parse_assign`], followed by the route's
/// entry number, the client's, the member's (0: none) and the admission time.
pub fn parse_assign_reserved(
    reply: &Value,
    windows: Option<usize>,
) -> Result<Option<Reserved>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(reply));
    };
    let Some(at) = items.len().checked_sub(4) else {
        return Err(unexpected(reply));
    };
    let number = |v: &Value| match v {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        _ => Err(unexpected(reply)),
    };
    let (route, client, member, at_us) = (
        number(&items[at])?,
        number(&items[at + 1])?,
        number(&items[at + 2])?,
        number(&items[at + 3])?,
    );
    let entry = |seq: u64| (seq > 0).then_some(EntryId { seq, at_us });
    let assignment = parse_assign(&Value::Array(items[..at].to_vec()), windows)?;
    Ok(assignment.map(|assignment| Reserved {
        assignment,
        route: entry(route),
        member: entry(member),
        client: entry(client),
    }))
}

/// `{total, open}` per window (`usage_run.lua`'s "read").
pub fn parse_usage(reply: &[i64], windows: usize) -> Result<Vec<WindowUsage>, StoreError> {
    if reply.len() != 2 * windows || reply.iter().any(|&v| v < 0) {
        return Err(StoreError::Backend(format!(
            "usage script read {reply:?} for {windows} windows"
        )));
    }
    Ok(reply
        .chunks_exact(2)
        .map(|c| WindowUsage {
            total: c[0] as u64,
            open: c[1] as u64,
        })
        .collect())
}

/// `{state per settlement and window}` (`usage_run.lua`'s "settle") → one list per settlement,
/// of `windows[i]` states each.
pub fn parse_settled(reply: &[i64], windows: &[usize]) -> Result<Vec<Vec<Settled>>, StoreError> {
    if reply.len() != windows.iter().sum::<usize>() {
        return Err(StoreError::Backend(format!(
            "usage script returned {} settlement states, expected {}",
            reply.len(),
            windows.iter().sum::<usize>()
        )));
    }
    let mut states = reply.iter().map(|&s| match s {
        0 => Ok(Settled::Gone),
        1 => Ok(Settled::Done),
        2 => Ok(Settled::Overrun),
        other => Err(StoreError::Backend(format!(
            "usage script returned the settlement state {other}"
        ))),
    });
    windows
        .iter()
        .map(|&n| states.by_ref().take(n).collect())
        .collect()
}

/// `{admitted, retry_after_us, remaining_i, reset_us_i..., entry}` (`client_run.lua`) → the
/// decision over `windows` windows (the route's, then the client's), and the client's entry
/// when one was recorded.
pub fn parse_client(
    reply: &Value,
    windows: usize,
) -> Result<(Outcome, Option<String>), StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(reply));
    };
    let Some((last, rest)) = items.split_last() else {
        return Err(unexpected(reply));
    };
    let entry = match last {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        _ => return Err(unexpected(reply)),
    };
    let numbers = rest
        .iter()
        .map(|v| match v {
            Value::Int(i) => Ok(*i),
            _ => Err(unexpected(reply)),
        })
        .collect::<Result<Vec<i64>, StoreError>>()?;
    let outcome = parse_quota(&numbers, windows)?;
    Ok((outcome, (!entry.is_empty()).then_some(entry)))
}

fn unexpected(reply: &Value) -> StoreError {
    StoreError::Backend(format!("unexpected allocator reply {reply:?}"))
}

/// `{status, member, quota reply...}` (`allocator_run.lua`, `fused_run.lua`) → an assignment,
/// or `None` when the pool must be synced first. `windows` is the quota's window count, for
/// fused calls.
pub fn parse_assignment(
    reply: &Value,
    windows: Option<usize>,
) -> Result<Option<Assignment>, StoreError> {
    parse_reply(reply, windows, false)
}

/// `{status, member, wait_us, quota reply...}` (`assign_run.lua`) → an assignment, or `None`
/// when the pool must be synced first. `windows` is the route quota's window count, if any.
pub fn parse_assign(
    reply: &Value,
    windows: Option<usize>,
) -> Result<Option<Assignment>, StoreError> {
    parse_reply(reply, windows, true)
}

fn parse_reply(
    reply: &Value,
    windows: Option<usize>,
    with_wait: bool,
) -> Result<Option<Assignment>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(reply));
    };
    let int = |v: &Value| match v {
        Value::Int(i) => Some(*i),
        _ => None,
    };
    let status = items
        .first()
        .and_then(int)
        .ok_or_else(|| unexpected(reply))?;
    if status == 3 {
        return Ok(None);
    }
    let member = match items.get(1) {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    };
    let wait = if with_wait {
        let wait = items
            .get(2)
            .and_then(int)
            .ok_or_else(|| unexpected(reply))?;
        u64::try_from(wait).map_err(|_| unexpected(reply))?
    } else {
        0
    };
    let quota_at = if with_wait { 3 } else { 2 };
    let quota = match windows {
        Some(n) => {
            let rest = items.get(quota_at..).unwrap_or_default();
            let numbers: Vec<i64> = rest.iter().filter_map(int).collect();
            if numbers.len() != rest.len() {
                return Err(unexpected(reply));
            }
            Some(parse_quota(&numbers, n)?)
        }
        None if items.len() != quota_at => return Err(unexpected(reply)),
        None => None,
    };
    Ok(match status {
        1 if !member.is_empty() => Some(Assignment::Assigned { member, quota }),
        2 => Some(Assignment::NoMember { quota }),
        0 => Some(Assignment::QuotaRefused(
            quota.ok_or_else(|| unexpected(reply))?,
        )),
        4 if with_wait => Some(Assignment::Busy {
            retry_after_us: wait,
            quota,
        }),
        5 if with_wait => Some(Assignment::Concurrency { quota }),
        6 if with_wait => Some(Assignment::ClientConcurrency { quota }),
        _ => return Err(unexpected(reply)),
    })
}

/// `{member, µs left, ...}` (`cool_run.lua`'s `list`) → the cooling members.
pub fn parse_cooldowns(reply: &Value) -> Result<Vec<(String, u64)>, StoreError> {
    let bad = || StoreError::Backend(format!("unexpected cooldowns reply {reply:?}"));
    let items = match reply {
        Value::Array(items) => items.as_slice(),
        // An empty Lua table may come back as nil through some proxies.
        Value::Nil => &[],
        _ => return Err(bad()),
    };
    if items.len() % 2 != 0 {
        return Err(bad());
    }
    items
        .chunks_exact(2)
        .map(|pair| {
            let member = match &pair[0] {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return Err(bad()),
            };
            match pair[1] {
                Value::Int(left) if left >= 0 => Ok((member, left as u64)),
                _ => Err(bad()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        let shapes = [
            Value::Nil,
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Int(0)]),
            Value::Array(vec![Value::Int(1), Value::Nil, Value::Int(1)]),
            Value::Array(vec![Value::Int(9), Value::SimpleString("m".into())]),
            Value::Array(vec![
                Value::Int(1),
                Value::SimpleString("m".into()),
                Value::SimpleString("x".into()),
            ]),
        ];
        for windows in [None, Some(0), Some(1), Some(2)] {
            for reply in &shapes {
                // Whatever it says, it must not panic; the shapes above are all malformed for
                // fused calls.
                let parsed = parse_assignment(reply, windows);
                if windows.is_some() {
                    assert!(parsed.is_err(), "{reply:?} with {windows:?} → {parsed:?}");
                }
            }
        }
        assert!(parse_quota(&[1], 0).is_err());
        assert!(parse_quota(&[1, 0, 5], 1).is_err());

        // The assign script's replies carry a wait after the member.
        let member = || Value::BulkString(b"key-a".to_vec());
        let assign_shapes = [
            Value::Nil,
            Value::Okay,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1), member()]),
            Value::Array(vec![Value::Int(4), Value::SimpleString(String::new())]),
            Value::Array(vec![Value::Int(4), member(), Value::Int(-5)]),
            Value::Array(vec![Value::Int(4), member(), Value::Nil]),
            Value::Array(vec![Value::Int(1), Value::Nil, Value::Int(0)]),
            Value::Array(vec![Value::Int(9), member(), Value::Int(0)]),
            Value::Array(vec![Value::Int(1), member(), Value::Int(0), Value::Int(1)]),
            Value::Array(vec![
                Value::Int(0),
                member(),
                Value::Int(0),
                Value::SimpleString("x".into()),
            ]),
        ];
        for windows in [None, Some(1)] {
            for reply in &assign_shapes {
                let parsed = parse_assign(reply, windows);
                assert!(parsed.is_err(), "{reply:?} with {windows:?} → {parsed:?}");
            }
        }
        // The old scripts never answer busy.
        let busy = Value::Array(vec![Value::Int(4), member()]);
        assert!(parse_assignment(&busy, None).is_err());

        for reply in [
            Value::Int(3),
            Value::Array(vec![member()]),
            Value::Array(vec![Value::Int(1), member()]),
            Value::Array(vec![member(), Value::Int(-1)]),
            Value::Array(vec![member(), Value::Nil]),
        ] {
            assert!(parse_cooldowns(&reply).is_err(), "{reply:?}");
        }
    }

    /// The client script's reply ends with the client's entry; any other shape is an error.
    #[test]
    fn client_replies_parse_and_malformed_ones_are_errors() {
        let entry = |e: &str| Value::BulkString(e.as_bytes().to_vec());
        let reply = Value::Array(vec![
            Value::Int(1),
            Value::Int(0),
            Value::Int(9),
            Value::Int(60),
            Value::Int(2),
            Value::Int(30),
            entry("7:1"),
        ]);
        let (outcome, recorded) = parse_client(&reply, 2).unwrap();
        assert!(outcome.admitted);
        assert_eq!(outcome.windows.len(), 2);
        assert_eq!(outcome.windows[1].remaining, 2);
        assert_eq!(recorded.as_deref(), Some("7:1"));
        let refused = Value::Array(vec![
            Value::Int(0),
            Value::Int(5),
            Value::Int(0),
            Value::Int(5),
            entry(""),
        ]);
        assert_eq!(parse_client(&refused, 1).unwrap().1, None);
        for shape in [
            Value::Nil,
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![entry("")]),
            Value::Array(vec![Value::Int(1), Value::Int(0), Value::Int(3)]),
            Value::Array(vec![Value::Int(1), Value::Int(0), entry("1:1"), entry("")]),
            Value::Array(vec![
                Value::Int(1),
                Value::Int(0),
                Value::Int(3),
                Value::Int(0),
                entry("1:1"),
            ]),
        ] {
            assert!(parse_client(&shape, 2).is_err(), "{shape:?}");
        }
    }

    #[test]
    fn assign_replies_parse() {
        let busy = Value::Array(vec![
            Value::Int(4),
            Value::BulkString(Vec::new()),
            Value::Int(1_500),
            Value::Int(1),
            Value::Int(0),
            Value::Int(7),
            Value::Int(20),
        ]);
        assert_eq!(
            parse_assign(&busy, Some(1)).unwrap().unwrap(),
            Assignment::Busy {
                retry_after_us: 1_500,
                quota: Some(Outcome {
                    admitted: true,
                    retry_after_us: 0,
                    windows: vec![WindowState {
                        remaining: 7,
                        reset_us: 20
                    }]
                })
            }
        );
        let assigned = Value::Array(vec![
            Value::Int(1),
            Value::BulkString(b"key-b".to_vec()),
            Value::Int(0),
        ]);
        assert_eq!(
            parse_assign(&assigned, None).unwrap().unwrap(),
            Assignment::Assigned {
                member: "key-b".into(),
                quota: None
            }
        );
        let resync = Value::Array(vec![
            Value::Int(3),
            Value::BulkString(Vec::new()),
            Value::Int(0),
        ]);
        assert_eq!(parse_assign(&resync, None).unwrap(), None);
        let cooling = Value::Array(vec![
            Value::BulkString(b"key-a".to_vec()),
            Value::Int(10),
            Value::BulkString(b"key-b".to_vec()),
            Value::Int(20),
        ]);
        assert_eq!(
            parse_cooldowns(&cooling).unwrap(),
            [("key-a".to_string(), 10), ("key-b".to_string(), 20)]
        );
        assert!(parse_cooldowns(&Value::Array(vec![])).unwrap().is_empty());
    }

    #[test]
    fn well_formed_replies_parse() {
        let reply = Value::Array(vec![
            Value::Int(1),
            Value::BulkString(b"http://a".to_vec()),
            Value::Int(1),
            Value::Int(0),
            Value::Int(4),
            Value::Int(1000),
        ]);
        let a = parse_assignment(&reply, Some(1)).unwrap().unwrap();
        assert_eq!(
            a,
            Assignment::Assigned {
                member: "http://a".into(),
                quota: Some(Outcome {
                    admitted: true,
                    retry_after_us: 0,
                    windows: vec![WindowState {
                        remaining: 4,
                        reset_us: 1000
                    }]
                })
            }
        );
        let resync = Value::Array(vec![Value::Int(3), Value::SimpleString(String::new())]);
        assert_eq!(parse_assignment(&resync, None).unwrap(), None);
    }

    /// A reservation's reply carries its entry after the windows; settlements one state per
    /// window. Anything else is an error, never a panic or a made-up entry.
    #[test]
    fn usage_replies_parse_and_malformed_ones_are_errors() {
        let admitted = parse_reservation(&[1, 0, 9, 100, 7, 1_700_000_000_000_000], 1).unwrap();
        assert!(admitted.outcome.admitted);
        assert_eq!(
            admitted.entry,
            Some(EntryId {
                seq: 7,
                at_us: 1_700_000_000_000_000
            })
        );
        let refused = parse_reservation(&[0, 50, 0, 100, 0, 0], 1).unwrap();
        assert_eq!(refused.entry, None);
        for bad in [
            &[][..],
            &[1][..],
            &[1, 0, 9, 100][..],
            &[1, 0, 9, 100, 0, 5][..],
            &[0, 50, 0, 100, 3, 5][..],
            &[1, 0, 9, 100, -1, 5][..],
            &[1, 0, 9, 100, 7, 1, 2][..],
        ] {
            assert!(parse_reservation(bad, 1).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_settled(&[1, 2, 0], &[2, 0, 1]).unwrap(),
            vec![
                vec![Settled::Done, Settled::Overrun],
                vec![],
                vec![Settled::Gone]
            ]
        );
        assert!(parse_settled(&[1, 2], &[3]).is_err());
        assert!(parse_settled(&[1, 3], &[2]).is_err());
        assert!(parse_settled(&[-1], &[1]).is_err());
        assert_eq!(
            parse_usage(&[10, 4], 1).unwrap(),
            [WindowUsage { total: 10, open: 4 }]
        );
        assert!(parse_usage(&[10], 1).is_err());
        assert!(parse_usage(&[10, -4], 1).is_err());
        // An assignment that reserved usage ends with its entries; the pool missing is no
        // assignment; anything shorter or not numbers is an error.
        let assigned = Value::Array(vec![
            Value::Int(1),
            Value::SimpleString("key-a".into()),
            Value::Int(0),
            Value::Int(4),
            Value::Int(0),
            Value::Int(9),
            Value::Int(7),
        ]);
        let reserved = parse_assign_reserved(&assigned, None).unwrap().unwrap();
        assert_eq!(reserved.route, Some(EntryId { seq: 4, at_us: 7 }));
        assert_eq!(reserved.client, None);
        assert_eq!(reserved.member, Some(EntryId { seq: 9, at_us: 7 }));
        let missing = Value::Array(vec![
            Value::Int(3),
            Value::SimpleString(String::new()),
            Value::Int(0),
            Value::Int(0),
            Value::Int(0),
            Value::Int(0),
            Value::Int(0),
        ]);
        assert_eq!(parse_assign_reserved(&missing, None).unwrap(), None);
        for bad in [
            Value::Nil,
            Value::Array(vec![Value::Int(1), Value::Int(2)]),
            Value::Array(vec![
                Value::Int(3),
                Value::SimpleString(String::new()),
                Value::Int(0),
            ]),
            Value::Array(vec![
                Value::Int(1),
                Value::SimpleString("key-a".into()),
                Value::Int(0),
                Value::Int(-4),
                Value::Int(0),
                Value::Int(9),
                Value::Int(7),
            ]),
        ] {
            assert!(parse_assign_reserved(&bad, None).is_err(), "{bad:?}");
        }
    }
}
