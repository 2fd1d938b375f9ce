//! One call of a state script (`FCALL`, or `EVALSHA`), written straight into the command's buffer.
//!
//! The redis crate's `ScriptInvocation` keeps every key and argument in a `Vec` of its own and
//! copies them all into the command when it is invoked; sluice's keys were `format!`ted
//! `String`s on top of that. A key-pool assignment has many keys and arguments, so that was
//! dozens of allocations and two copies per request, most of what a key-pool request cost sluice
//! over a least-used one (`scripts/profile ROUTE=kp`, docs/benchmarks.md). Here the command is
//! one buffer: a key is written piece by piece where it belongs, an integer through
//! the crate's own formatting, and nothing is copied again before the socket.
//!
//! The price is that the number of keys must be known before the first key is written
//! (`FCALL name numkeys key… arg…`), so callers count them first.

use std::borrow::Cow;
use std::io::Write;
use std::sync::atomic::Ordering;

use redis::{
    Arg, Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, RedisWrite, ServerErrorKind,
    ToRedisArgs,
};

use sluice_limiter::Acquire;

use crate::scripts::{Library, StateScript};

/// Arguments after the keys that a call is sized for before it grows: a route's and its
/// members' limits, a clock, a cost, the members left out.
const ARGS_ROOM: usize = 16;
/// `EVALSHA`, the script's 40-digit hash and the key count (a function's name is shorter).
const HEAD_BYTES: usize = 56;
/// A key: `sluice:{route}:…` with a member's name or a window's.
const KEY_BYTES: usize = 48;
/// The arguments' bytes, for `ARGS_ROOM` of them.
const ARGS_BYTES: usize = 160;

/// A call as written ([`ScriptCall::into_parts`]): the command and its key count, shared by
/// the requests it was written for (redis/written.rs) and read by their batch (batch.rs).
pub(crate) type Written = std::sync::Arc<(Cmd, usize)>;

/// A call of one of `library`'s operations being written: keys first, then arguments. It is
/// an `FCALL` of the operation's function, or, when this Redis does not take functions, an
/// `EVALSHA` of its script.
pub struct ScriptCall<'s> {
    script: &'s StateScript,
    library: &'s Library,
    fcall: bool,
    /// Written here, or (`ScriptCall::written`) as another call wrote it, and sent as is.
    cmd: Cow<'s, Cmd>,
    keys: usize,
    keys_left: usize,
}

impl<'s> ScriptCall<'s> {
    /// A call of `script` that will take exactly `keys` keys.
    pub fn new(library: &'s Library, script: &'s StateScript, keys: usize) -> ScriptCall<'s> {
        // A call that names no key is routed by a Cluster client to any node, and a replica
        // refuses a script that writes (READONLY): every call names the keys it touches.
        debug_assert!(keys > 0, "a script call that names no key");
        // Room for the whole call up front: the command's two `Vec`s (its bytes, and where each
        // argument ends) otherwise grow by doubling, argument by argument.
        let args = 3 + keys + ARGS_ROOM;
        let mut cmd = Cmd::with_capacity(args, HEAD_BYTES + keys * KEY_BYTES + ARGS_BYTES);
        let fcall = library.functions();
        if fcall {
            cmd.arg("FCALL").arg(&script.function);
        } else {
            cmd.arg("EVALSHA").arg(script.eval.get_hash());
        }
        cmd.arg(keys);
        ScriptCall {
            script,
            library,
            fcall,
            cmd: Cow::Owned(cmd),
            keys,
            keys_left: keys,
        }
    }

    /// `written`, a call of `script` written whole, to be sent as it is, without a copy; `None`
    /// when it was written the other way (`FCALL` or `EVALSHA`) than calls go now (this store
    /// has since found Redis refusing functions), or for another script.
    pub fn written(
        library: &'s Library,
        script: &'s StateScript,
        written: &'s Written,
    ) -> Option<ScriptCall<'s>> {
        let (cmd, keys) = &**written;
        let fcall = library.functions();
        let mut args = cmd.args_iter();
        let (Some(Arg::Simple(head)), Some(Arg::Simple(name))) = (args.next(), args.next()) else {
            return None;
        };
        let name_is = if fcall {
            name == script.function.as_bytes()
        } else {
            name == script.eval.get_hash().as_bytes()
        };
        if !name_is {
            return None;
        }
        (head == if fcall { &b"FCALL"[..] } else { b"EVALSHA" }).then_some(ScriptCall {
            script,
            library,
            fcall,
            cmd: Cow::Borrowed(cmd),
            keys: *keys,
            keys_left: 0,
        })
    }

    /// Appends a key made of `parts`, concatenated.
    pub fn key(&mut self, parts: &[&str]) -> &mut Self {
        debug_assert!(self.keys_left > 0, "more keys than announced");
        self.keys_left = self.keys_left.saturating_sub(1);
        {
            debug_assert!(
                matches!(self.cmd, Cow::Owned(_)),
                "a shared call written to"
            );
            let mut w = self.cmd.to_mut().writer_for_next_arg();
            for p in parts {
                // Writing into the command's Vec cannot fail.
                let _ = w.write_all(p.as_bytes());
            }
        }
        self
    }

    /// Appends a key given whole, as another call's [`ScriptCall::into_parts`] gave it.
    pub fn raw_key(&mut self, key: &[u8]) -> &mut Self {
        debug_assert!(self.keys_left > 0, "more keys than announced");
        self.keys_left = self.keys_left.saturating_sub(1);
        debug_assert!(
            matches!(self.cmd, Cow::Owned(_)),
            "a shared call written to"
        );
        self.cmd.to_mut().arg(key);
        self
    }

    /// The call as written, for a batched call to copy its keys and arguments from (batch.rs):
    /// the command (its first three arguments name the call and count its keys) and its key
    /// count.
    pub fn into_parts(self) -> (Cmd, usize) {
        debug_assert_eq!(self.keys_left, 0, "fewer keys than announced");
        (self.cmd.into_owned(), self.keys)
    }

    /// Appends an argument (after every key).
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        debug_assert!(
            matches!(self.cmd, Cow::Owned(_)),
            "a shared call written to"
        );
        self.cmd.to_mut().arg(arg);
        self
    }

    /// Appends the quota arguments (cost, clock, then name, limit, length per window), as the
    /// quota library's drivers read them.
    pub fn quota_args(&mut self, req: &Acquire<'_>) -> &mut Self {
        self.arg(req.cost);
        match req.at_us {
            Some(t) => self.arg(t),
            None => self.arg(""),
        };
        for w in req.windows {
            self.arg(&*w.name).arg(w.limit).arg(w.length_us);
        }
        self
    }

    /// Appends a list of excluded member ids, count first, as `pool_excluded` reads it.
    pub fn excluded<S: AsRef<str>>(&mut self, excluded: &[S]) -> &mut Self {
        self.arg(excluded.len());
        for e in excluded {
            self.arg(e.as_ref());
        }
        self
    }

    /// Sends the call. Whenever Redis answers that it did not run it, the call is made again
    /// the way that will run, once each way; a call Redis refused never ran, so nothing runs
    /// twice:
    /// - an unknown function (first use, a restart without persistence, `FUNCTION FLUSH`, a new
    ///   cluster node): the library is loaded, and the `FCALL` sent once more;
    /// - no functions at all (Redis 6, an ACL without `FUNCTION`), a library Redis will not
    ///   load, or one that could not be loaded just now (a cluster node out of reach): the call
    ///   goes as `EVALSHA`, and all but the last case stop this store from trying functions
    ///   again;
    /// - an unknown script (as above, for scripts): the script is loaded and sent once more.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> RedisResult<T> {
        debug_assert_eq!(self.keys_left, 0, "fewer keys than announced");
        if !self.fcall {
            return evalsha(&self.cmd, self.script, conn).await;
        }
        match self.cmd.query_async(conn).await {
            Err(e) if function_missing(&e) => match self.load(conn).await {
                Ok(()) => match self.cmd.query_async(conn).await {
                    Err(e) if function_missing(&e) => {}
                    other => return other,
                },
                // Redis answered, and will not take this library (its user may not load
                // functions, or its Lua will not compile the text): scripts from now on, rather
                // than three round trips a call. Anything else (a node out of reach, OOM) may
                // pass: this call goes as a script, and the next tries the library again.
                Err(e)
                    if functions_refused(&e)
                        || e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) =>
                {
                    self.library.refuse_functions()
                }
                Err(_) => {}
            },
            Err(e) if functions_refused(&e) => self.library.refuse_functions(),
            other => return other,
        }
        evalsha(&self.as_evalsha(), self.script, conn).await
    }

    /// Loads the whole library on every node that takes writes (the cluster client sends
    /// `FUNCTION LOAD` to every master). `REPLACE`: another instance of the same version may
    /// have loaded it a moment ago, with the same text. One load at a time per store: a call
    /// that found its function missing while another call of this store was loading it waits
    /// for that load and does not load again ([`Library::loads`]).
    async fn load(&self, conn: &mut impl redis::aio::ConnectionLike) -> RedisResult<()> {
        let seen = self.library.loads.load(Ordering::Acquire);
        let _one_at_a_time = self.library.loading.lock().await;
        if self.library.loads.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.library.source)
            .query_async::<redis::Value>(conn)
            .await?;
        self.library.loads.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// The same call as an `EVALSHA`: the arguments after `FCALL` and the function's name.
    fn as_evalsha(&self) -> Cmd {
        let mut cmd = Cmd::with_capacity(self.cmd.args_iter().len(), HEAD_BYTES);
        cmd.arg("EVALSHA").arg(self.script.eval.get_hash());
        for a in self.cmd.args_iter().skip(2) {
            if let Arg::Simple(bytes) = a {
                cmd.arg(bytes);
            }
        }
        cmd
    }
}

/// Sends an `EVALSHA`; when Redis does not know the script (first use, a restart, `SCRIPT
/// FLUSH`), loads it and sends the same call once more.
async fn evalsha<T: FromRedisValue>(
    cmd: &Cmd,
    script: &StateScript,
    conn: &mut impl redis::aio::ConnectionLike,
) -> RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.eval.prepare_invoke().load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// "ERR Function not found": this node has no such function (yet).
fn function_missing(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && e.detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// Redis will not run functions for this client: it has no such command (before 7.0), or the
/// user's ACL does not allow it (`NOPERM`). Only an error that names `FCALL` or `FUNCTION` as
/// the command refused counts (Redis quotes it: 'fcall', `FCALL`, 'function|load'): the same
/// codes from a command inside a function that ran part way (whose message ends "on
/// @user_function:LINE") must not send the call again as a script.
fn functions_refused(e: &RedisError) -> bool {
    let about_functions = || {
        e.detail().is_some_and(|d| {
            let d = d.to_ascii_lowercase();
            ["'fcall'", "`fcall`", "'function", "`function"]
                .iter()
                .any(|c| d.contains(c))
        })
    };
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => about_functions(),
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            e.detail().is_some_and(|d| d.starts_with("unknown command")) && about_functions()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::Scripts;

    #[test]
    fn a_written_call_goes_as_is_only_the_way_calls_go_now() {
        let scripts = Scripts::new();
        let mut call = ScriptCall::new(&scripts.library, &scripts.assign, 1);
        call.key(&["sluice:{pool}:p"]).arg("L");
        let written: Written = std::sync::Arc::new(call.into_parts());
        let as_is = ScriptCall::written(&scripts.library, &scripts.assign, &written)
            .expect("written as an FCALL, sent as one");
        assert!(matches!(as_is.cmd, Cow::Borrowed(_)));
        assert!(ScriptCall::written(&scripts.library, &scripts.quota, &written).is_none());
        // Once Redis refused functions, calls go as EVALSHA: one written as an FCALL is
        // written again (batch.rs copies its keys and arguments under the new head).
        scripts.library.refuse_functions();
        assert!(ScriptCall::written(&scripts.library, &scripts.assign, &written).is_none());
        let mut call = ScriptCall::new(&scripts.library, &scripts.assign, 1);
        call.key(&["sluice:{pool}:p"]).arg("L");
        let written: Written = std::sync::Arc::new(call.into_parts());
        assert!(ScriptCall::written(&scripts.library, &scripts.assign, &written).is_some());
    }
}
