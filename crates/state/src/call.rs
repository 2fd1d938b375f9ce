//! One `EVALSHA`, written straight into the command's buffer.
//!
//! The redis crate's `ScriptInvocation` keeps every key and argument in a `Vec` of its own and
//! copies them all into the command when it is invoked; sluice's keys were `format!`ted
//! `String`s on top of that. A key-pool assignment has a dozen keys and two dozen arguments, so
//! that was about 60 allocations and two copies per request (15k instructions of sluice's 24k
//! more per key-pool request than per least-used one, in `scripts/profile ROUTE=kp`). Here the
//! command is one buffer: a key is written piece by piece where it belongs, an integer through
//! the crate's own formatting, and nothing is copied again before the socket.
//!
//! The price is that the number of keys must be known before the first key is written
//! (`EVALSHA sha numkeys key… arg…`), so callers count them first.

use std::io::Write;

use redis::{
    Cmd, ErrorKind, FromRedisValue, RedisResult, RedisWrite, Script, ServerErrorKind, ToRedisArgs,
};

/// Arguments after the keys that a call is sized for before it grows: a route's and its
/// members' limits, a clock, a cost, the members left out.
const ARGS_ROOM: usize = 16;
/// `EVALSHA`, the script's 40-digit hash and the key count.
const HEAD_BYTES: usize = 56;
/// A key: `sluice:{route}:…` with a member's name or a window's.
const KEY_BYTES: usize = 48;
/// The arguments' bytes, for `ARGS_ROOM` of them.
const ARGS_BYTES: usize = 160;

/// An `EVALSHA` of `script` being written: keys first, then arguments.
pub struct ScriptCall<'s> {
    script: &'s Script,
    cmd: Cmd,
    keys_left: usize,
}

impl<'s> ScriptCall<'s> {
    /// A call of `script` that will take exactly `keys` keys.
    pub fn new(script: &'s Script, keys: usize) -> ScriptCall<'s> {
        // Room for the whole call up front: the command's two `Vec`s (its bytes, and where each
        // argument ends) otherwise grow by doubling, argument by argument.
        let args = 3 + keys + ARGS_ROOM;
        let mut cmd = Cmd::with_capacity(args, HEAD_BYTES + keys * KEY_BYTES + ARGS_BYTES);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        ScriptCall {
            script,
            cmd,
            keys_left: keys,
        }
    }

    /// Appends a key made of `parts`, concatenated.
    pub fn key(&mut self, parts: &[&str]) -> &mut Self {
        debug_assert!(self.keys_left > 0, "more keys than announced");
        self.keys_left = self.keys_left.saturating_sub(1);
        {
            let mut w = self.cmd.writer_for_next_arg();
            for p in parts {
                // Writing into the command's Vec cannot fail.
                let _ = w.write_all(p.as_bytes());
            }
        }
        self
    }

    /// Appends an argument (after every key).
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        self.cmd.arg(arg);
        self
    }

    /// Sends the call; when Redis does not know the script (first use, a restart, `SCRIPT
    /// FLUSH`), loads it and sends the same call once more. The first attempt never ran, so
    /// nothing runs twice.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> RedisResult<T> {
        debug_assert_eq!(self.keys_left, 0, "fewer keys than announced");
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.prepare_invoke().load_async(conn).await?;
                self.cmd.query_async(conn).await
            }
            other => other,
        }
    }
}
