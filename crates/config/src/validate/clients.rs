//! The rules of `clients:` that span several fields: across clients, and between clients and
//! routes. No message names a token: a clash is told by the clients' names and positions.

use std::collections::HashMap;

use super::super::position::YamlPath;
use super::super::schema::*;
use super::super::Config;
use super::{at_most, check_windows, MAX_DELAY};

/// The problems of `config.clients`, and of the route settings that need it.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let Some(clients) = &config.clients else {
        for (i, route) in config.routes.iter().enumerate() {
            let at = YamlPath::root().key("routes").index(i);
            if route.client_token.is_some() {
                problems.push((
                    at.clone().key("client_token"),
                    "client_token identifies clients, and there is no clients section; add one, or leave client_token out".to_string(),
                ));
            }
            if route
                .quota
                .as_ref()
                .is_some_and(|q| q.key == QuotaKey::Client)
            {
                problems.push((
                    at.key("quota").key("key"),
                    "quota key client counts per identified client, and there is no clients section; add one, or use another key".to_string(),
                ));
            }
        }
        return problems;
    };
    let at = YamlPath::root().key("clients");
    let failed_at = at.clone().key("failed_auth");
    for (d, key, what) in [
        (clients.failed_auth.window, "window", "a window"),
        (clients.failed_auth.cooldown, "cooldown", "a cooldown"),
    ] {
        at_most(
            &mut problems,
            failed_at.clone().key(key),
            d,
            MAX_DELAY,
            what,
        );
    }
    let routes: std::collections::HashSet<&str> =
        config.routes.iter().map(|r| r.name.0.as_str()).collect();
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut tokens: HashMap<&str, (usize, usize)> = HashMap::new();
    // Keyed as the gateway looks a presented name up: two names that compare equal there
    // would leave the second client unreachable.
    let mut certs: HashMap<String, usize> = HashMap::new();
    let mut by_address: Vec<(usize, Cidr)> = Vec::new();
    for (i, client) in clients.list.iter().enumerate() {
        let client_at = at.clone().key("list").index(i);
        let name = client.name.0.as_str();
        if name == UNKNOWN {
            problems.push((
                client_at.clone().key("name"),
                format!("{UNKNOWN:?} is the name logs and metrics give callers no client matched; choose another name"),
            ));
        }
        if let Some(&first) = names.get(name) {
            problems.push((
                client_at.clone().key("name"),
                format!("duplicate client name {name:?}: list[{first}] already has it"),
            ));
        } else {
            names.insert(name, i);
        }
        if client.tokens.is_empty()
            && client.certs.is_empty()
            && client.cidrs.is_empty()
            && name != ANONYMOUS
        {
            problems.push((
                client_at.clone(),
                "nothing identifies this client: give it tokens, certs or cidrs".to_string(),
            ));
        }
        for (j, token) in client.tokens.iter().enumerate() {
            match tokens.get(token.0.as_str()) {
                Some(&(first, k)) => problems.push((
                    client_at.clone().key("tokens").index(j),
                    if first == i {
                        format!("this token is also tokens[{k}] of this client")
                    } else {
                        format!(
                            "this token is also a token of list[{first}] ({}): a token identifies one client",
                            clients.list[first].name.0
                        )
                    },
                )),
                None => {
                    tokens.insert(&token.0, (i, j));
                }
            }
        }
        for (j, cert) in client.certs.iter().enumerate() {
            let canonical = crate::listen_tls::canonical_name(&cert.0);
            match certs.get(&canonical) {
                Some(&first) => problems.push((
                    client_at.clone().key("certs").index(j),
                    format!(
                        "{:?} is also a certificate name of list[{first}] ({}): a name identifies one client",
                        cert.0, clients.list[first].name.0
                    ),
                )),
                None => {
                    certs.insert(canonical, i);
                }
            }
        }
        if client.address_only() {
            for (j, cidr) in client.cidrs.iter().enumerate() {
                let clash = by_address.iter().find(|(other, c)| {
                    *other != i && (c.0.contains(&cidr.0) || cidr.0.contains(&c.0))
                });
                if let Some(&(other, c)) = clash {
                    problems.push((
                        client_at.clone().key("cidrs").index(j),
                        format!(
                            "{} overlaps {} of list[{other}] ({}), and both clients are known by address alone, so a caller there would be either; give them tokens or certs, or cidrs apart",
                            cidr.0, c.0, clients.list[other].name.0
                        ),
                    ));
                }
            }
            by_address.extend(client.cidrs.iter().map(|c| (i, *c)));
        }
        for (j, grant) in client.routes.iter().enumerate() {
            if let RouteGrant::Route(route) = grant {
                if !routes.contains(route.0.as_str()) {
                    problems.push((
                        client_at.clone().key("routes").index(j),
                        format!("there is no route named {:?}", route.0),
                    ));
                }
            }
        }
        if let Some(quota) = &client.quota {
            let quota_at = client_at.clone().key("quota");
            if quota.windows.is_empty() {
                problems.push((
                    quota_at.clone().key("windows"),
                    "a client quota needs at least one window".to_string(),
                ));
            }
            check_windows(&mut problems, &quota_at, &quota.windows);
        }
    }
    if clients.unknown == UnknownClients::Anonymous && !names.contains_key(ANONYMOUS) {
        problems.push((
            at.key("unknown"),
            format!("unknown: anonymous makes unidentified callers the client named {ANONYMOUS:?}, and the list has none; add it, with the routes they may use"),
        ));
    }
    problems
}
