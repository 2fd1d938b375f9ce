//! Rules that span several fields, run once every field has parsed.
//!
//! Each problem names the YAML path to blame; the caller turns the path into a line and column.

use std::collections::{HashMap, HashSet};

use super::position::YamlPath;
use super::schema::*;
use super::Config;

impl Config {
    /// Rules that span several fields. Each problem names the YAML path to blame.
    pub(super) fn validate(&self) -> Vec<(YamlPath, String)> {
        let mut problems = Vec::new();
        if self.listen.is_empty() {
            problems.push((
                YamlPath::root().key("listen"),
                "at least one listen address is required".to_string(),
            ));
        }
        if let Some(var) = &self.admin.token_env {
            if var.is_empty() {
                problems.push((
                    YamlPath::root().key("admin").key("token_env"),
                    "token_env must name an environment variable".to_string(),
                ));
            }
        }

        let redis = self.state.redis.as_ref();
        let url = redis.and_then(|r| r.url.as_ref());
        let cluster = redis.and_then(|r| r.cluster.as_ref());
        if self.state.backend == StateBackend::Redis && url.is_none() && cluster.is_none() {
            problems.push((
                YamlPath::root().key("state").key("backend"),
                "backend: redis needs state.redis.url or state.redis.cluster".to_string(),
            ));
        }
        if url.is_some() && cluster.is_some() {
            problems.push((
                YamlPath::root().key("state").key("redis").key("cluster"),
                "give either url (one Redis) or cluster (Redis Cluster nodes), not both"
                    .to_string(),
            ));
        }
        if cluster.is_some_and(|c| c.is_empty()) {
            problems.push((
                YamlPath::root().key("state").key("redis").key("cluster"),
                "cluster needs at least one node".to_string(),
            ));
        }

        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut claims: HashMap<(HostPattern, &str, Vec<MethodName>), usize> = HashMap::new();
        for (i, route) in self.routes.iter().enumerate() {
            let at = YamlPath::root().key("routes").index(i);
            // Name the first holder: with n copies of a name, every message then points at
            // the same route.
            if let Some(&first) = names.get(route.name.0.as_str()) {
                problems.push((
                    at.clone().key("name"),
                    format!(
                        "duplicate route name {:?}: routes[{first}] already has it",
                        route.name.0
                    ),
                ));
            } else {
                names.insert(&route.name.0, i);
            }
            let mut methods = route.matcher.methods.clone();
            methods.sort();
            methods.dedup();
            for host in &route.matcher.hosts {
                let key = (
                    host.clone(),
                    route.matcher.path_prefix.0.as_str(),
                    methods.clone(),
                );
                if let Some(&first) = claims.get(&key) {
                    problems.push((
                        at.clone().key("match"),
                        format!(
                            "routes[{first}] ({}) has the same host, path_prefix and methods, so this route could never match",
                            self.routes[first].name.0
                        ),
                    ));
                    break;
                }
                claims.insert(key, i);
            }

            let up = &route.upstream;
            let mut urls = HashSet::new();
            for (j, member) in up.members.iter().enumerate() {
                let member_at = at.clone().key("upstream").key("members").index(j);
                if !urls.insert(&member.url.url) {
                    problems.push((
                        member_at.clone().key("url"),
                        format!("duplicate member {:?} in this pool", member.url.url),
                    ));
                }
                if member.weight.is_some() {
                    let why = match up.selection {
                        Selection::RoundRobin => None,
                        Selection::LeastUsed => Some("least_used counts assignments"),
                        Selection::Priority => Some("priority follows the list order"),
                    };
                    if let Some(why) = why {
                        problems.push((
                            member_at.key("weight"),
                            format!("weight applies to round_robin only; {why}"),
                        ));
                    }
                }
            }
            // Only least_used keeps a count that a restored member could resume.
            if up.selection != Selection::LeastUsed && up.on_restore.is_some() {
                problems.push((
                    at.clone().key("upstream").key("on_restore"),
                    "on_restore applies to selection: least_used only".to_string(),
                ));
            }
            if let Some(quota) = &route.quota {
                let at = at.clone().key("quota");
                if quota.windows.is_empty() {
                    problems.push((
                        at.clone().key("windows"),
                        "a quota needs at least one window".to_string(),
                    ));
                }
                let mut window_names = HashSet::new();
                for (j, w) in quota.windows.iter().enumerate() {
                    if !window_names.insert(&w.name.0) {
                        problems.push((
                            at.clone().key("windows").index(j).key("name"),
                            format!("duplicate window name {:?}", w.name.0),
                        ));
                    }
                }
                if let Some(smallest) = quota.windows.iter().map(|w| w.limit.get()).min() {
                    let too_costly = |cost: u64| {
                        format!(
                            "cost {cost} exceeds the smallest window limit {smallest}: no such request could ever pass"
                        )
                    };
                    if quota.cost.default.get() > smallest {
                        problems.push((
                            at.clone().key("cost").key("default"),
                            too_costly(quota.cost.default.get()),
                        ));
                    }
                    for (j, rule) in quota.cost.rules.iter().enumerate() {
                        if rule.cost.get() > smallest {
                            problems.push((
                                at.clone().key("cost").key("rules").index(j).key("cost"),
                                too_costly(rule.cost.get()),
                            ));
                        }
                    }
                }
            }
            if let Some(check) = &up.health_check {
                if check.kind == CheckKind::Tcp && check.path.is_some() {
                    problems.push((
                        at.clone().key("upstream").key("health_check").key("path"),
                        "path applies to kind: http only".to_string(),
                    ));
                }
            }
        }
        problems
    }
}
