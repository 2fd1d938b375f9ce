// PATCH (sluice, header case kept in a list; third_party/PATCHES.md): a whole module.
//
//! The case of a head's header names, kept beside the map of their values.
//!
//! Upstream keeps the case in a second `HeaderMap`, fed the same operations as the map of
//! values so that the two iterate in step. That costs a second hash and probe for every
//! header line, and a second map (two allocations) for every head built, cloned and dropped:
//! about 3,700 instructions of a proxied request with one request and five response headers.
//!
//! A head rarely repeats a name, and while none repeats, the names' cases can live in a
//! plain list of (name, case) pairs: an append is a push, a clone one allocation, and the
//! list follows the value map's order as long as it is edited the way the map is (appends at
//! the end, a removal swapped with the last entry). Writing walks the value map and takes
//! each case from the same position of the list if the name there is the same, or finds the
//! name if the order ever differs: the order is a fast path, never a correctness assumption.
//! The names are kept rather than recovered from the cases because comparing two
//! `HeaderName`s is one integer compare for a standard name, where comparing bytes without
//! regard to case cost more than the whole list saves. The first repeated name turns
//! the list into upstream's second map, which handles repeats as before.

use http::header::{HeaderMap, HeaderName, MaxSizeReached};

use crate::case_header_name::{titled_header_name_str, CaseHeaderName, IntoCaseHeaderName};

/// Upstream's second map: each name's case, in step with the map of values.
pub(crate) type CaseMap = HeaderMap<CaseHeaderName>;

#[derive(Debug, Clone)]
pub(crate) enum CaseNames {
    /// The case is not kept (HTTP/2 heads, [`From`] conversions): names are written titled
    /// where a title is known, in lowercase otherwise.
    Off,
    /// No name appears twice: each name's case, usually in the value map's order.
    List(Vec<(HeaderName, CaseHeaderName)>),
    /// A name appears twice or more: upstream's second map.
    Map(CaseMap),
}

impl CaseNames {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        CaseNames::List(Vec::with_capacity(capacity))
    }

    pub(crate) fn is_on(&self) -> bool {
        !matches!(self, CaseNames::Off)
    }

    /// `values.try_append(name, value)`, keeping `case`. Returns whether `name` was there.
    pub(crate) fn append<T>(
        &mut self,
        values: &mut HeaderMap<T>,
        name: HeaderName,
        case: CaseHeaderName,
        value: T,
    ) -> Result<bool, MaxSizeReached> {
        match self {
            CaseNames::Off => values.try_append(name, value),
            CaseNames::Map(map) => {
                map.try_append(name.clone(), case)?;
                values.try_append(name, value)
            }
            CaseNames::List(list) => {
                let existed = values.try_append(name.clone(), value)?;
                if existed {
                    *self = CaseNames::Map(to_map(list, values, &case)?);
                } else {
                    list.push((name, case));
                }
                Ok(existed)
            }
        }
    }

    /// `values.try_insert(name, value)`, keeping `case`: the name's one case from now on.
    pub(crate) fn insert<T>(
        &mut self,
        values: &mut HeaderMap<T>,
        name: HeaderName,
        case: CaseHeaderName,
        value: T,
    ) -> Result<(), MaxSizeReached> {
        match self {
            CaseNames::Off => {
                values.try_insert(name, value)?;
            }
            CaseNames::Map(map) => {
                map.try_insert(name.clone(), case)?;
                values.try_insert(name, value)?;
            }
            CaseNames::List(list) => {
                // The map says whether the name is new, which spares a walk of the list.
                if values.try_insert(name.clone(), value)?.is_none() {
                    list.push((name, case));
                } else if let Some((_, old)) = list.iter_mut().find(|(n, _)| *n == name) {
                    *old = case;
                }
            }
        }
        Ok(())
    }

    /// To be called after `values` lost the one entry of a name (`HeaderMap::remove`
    /// returned a value). The name itself is not needed: it is the one the list has and
    /// `values` no longer does.
    pub(crate) fn removed<T>(
        &mut self,
        values: &HeaderMap<T>,
        remove_from_map: impl FnOnce(&mut CaseMap),
    ) {
        match self {
            CaseNames::Off => {}
            CaseNames::Map(map) => remove_from_map(map),
            CaseNames::List(list) => forget_removed(list, values),
        }
    }

    pub(crate) fn try_reserve(&mut self, additional: usize) -> Result<(), MaxSizeReached> {
        match self {
            CaseNames::Off => Ok(()),
            CaseNames::List(list) => {
                list.reserve(additional);
                Ok(())
            }
            CaseNames::Map(map) => map.try_reserve(additional),
        }
    }

    /// Every value of `values` in the map's order, with its name's case if it is kept.
    pub(crate) fn iter<'a, T>(
        &'a self,
        values: &'a HeaderMap<T>,
    ) -> impl Iterator<Item = (&'a HeaderName, Option<&'a CaseHeaderName>, &'a T)> + 'a {
        let mut in_step = match self {
            CaseNames::Map(map) => Some(map.iter()),
            _ => None,
        };
        values.iter().enumerate().map(move |(i, (name, value))| {
            let case = match self {
                CaseNames::Off => None,
                CaseNames::List(list) => case_in_list(list, i, name),
                CaseNames::Map(_) => in_step.as_mut().and_then(Iterator::next).map(|(n, c)| {
                    // Upstream's invariant: both maps were fed the same operations.
                    assert_eq!(n, name, "header iter mismatch {n}, {name}");
                    c
                }),
            };
            (name, case, value)
        })
    }
}

/// The name as it is written when its case is not kept.
pub(crate) fn titled(name: &HeaderName) -> &str {
    titled_header_name_str(name).unwrap_or(name.as_str())
}

/// `name`'s case: at position `i` when the list is in the map's order (a value map without
/// repeats iterates one value per entry), else wherever it is.
fn case_in_list<'a>(
    list: &'a [(HeaderName, CaseHeaderName)],
    i: usize,
    name: &HeaderName,
) -> Option<&'a CaseHeaderName> {
    match list.get(i) {
        Some((n, case)) if n == name => Some(case),
        _ => list.iter().find(|(n, _)| n == name).map(|(_, case)| case),
    }
}

/// Upstream's map for a head whose value map now holds one name twice, the second value
/// of which came with `case`; every other case comes from the list.
fn to_map<T>(
    list: &[(HeaderName, CaseHeaderName)],
    values: &HeaderMap<T>,
    case: &CaseHeaderName,
) -> Result<CaseMap, MaxSizeReached> {
    let mut map = CaseMap::try_with_capacity(values.len())?;
    for (entry, name) in values.keys().enumerate() {
        let first = case_in_list(list, entry, name)
            .cloned()
            .unwrap_or_else(|| name.into_case_header_name());
        map.try_append(name.clone(), first)?;
        // Only the name just appended has a second value.
        for _ in values.get_all(name).iter().skip(1) {
            map.try_append(name.clone(), case.clone())?;
        }
    }
    Ok(map)
}

/// Drops the pair of the name `values` just lost. `HeaderMap` removes an entry by moving
/// its last entry into the hole, so the list does the same at the first position where it
/// and the map differ; if that does not give the map's order, the list is rebuilt in it.
fn forget_removed<T>(list: &mut Vec<(HeaderName, CaseHeaderName)>, values: &HeaderMap<T>) {
    let hole = list
        .iter()
        .zip(values.keys())
        .position(|((n, _), key)| n != key)
        .unwrap_or(values.keys_len());
    if hole >= list.len() {
        return; // nothing was kept for it
    }
    let last = list.len() - 1;
    let swapped = (0..last).map(|j| if j == hole { last } else { j });
    if values.keys_len() == last && swapped.zip(values.keys()).all(|(j, key)| list[j].0 == *key) {
        list.swap_remove(hole);
    } else {
        let kept = values
            .keys()
            .filter_map(|key| list.iter().find(|(n, _)| n == key).cloned())
            .collect();
        *list = kept;
    }
}
