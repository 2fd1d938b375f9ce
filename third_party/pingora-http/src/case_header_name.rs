// Copyright 2026 Cloudflare, Inc.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
// http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

use crate::*;
use bytes::Bytes;
use http::header;

#[derive(Debug, Clone)]
pub struct CaseHeaderName(Bytes);

impl CaseHeaderName {
    pub fn new(name: String) -> Self {
        CaseHeaderName(name.into())
    }
}

impl CaseHeaderName {
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }

    pub fn from_slice(buf: &[u8]) -> Self {
        CaseHeaderName(Bytes::copy_from_slice(buf))
    }
}

/// A trait that converts into case-sensitive header names.
pub trait IntoCaseHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName;

    /// PATCH (sluice, prebuilt header names; third_party/PATCHES.md): the name both header
    /// maps are keyed by, with its case. By default the case bytes are parsed into a
    /// [HeaderName] (an allocation for a name that is not a standard one); a caller that
    /// already holds a [HeaderName] skips that.
    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)>
    where
        Self: Sized,
    {
        let case_header_name = self.into_case_header_name();
        let header_name = HeaderName::from_bytes(case_header_name.as_slice())
            .or_err(InvalidHTTPHeader, "invalid header name")?;
        Ok((header_name, case_header_name))
    }
}

/// PATCH (sluice, prebuilt header names; third_party/PATCHES.md): a header name known when
/// the program is written, kept with the case it is sent in, so that inserting it neither
/// parses nor allocates (both parts are static).
///
/// ```
/// use pingora_http::StaticHeaderName;
/// static X_REQUEST_ID: StaticHeaderName = StaticHeaderName::new("x-request-id", "X-Request-Id");
/// ```
#[derive(Debug, Clone)]
pub struct StaticHeaderName {
    name: HeaderName,
    case: &'static str,
}

impl StaticHeaderName {
    /// `name` in lowercase, as [HeaderName::from_static] takes it, and `case`, the same name
    /// as it is written on the wire. Either wrong is a compile error in a `const` or
    /// `static`, a panic elsewhere.
    pub const fn new(name: &'static str, case: &'static str) -> Self {
        let (lower, cased) = (name.as_bytes(), case.as_bytes());
        assert!(lower.len() == cased.len(), "case is not the same name");
        let mut i = 0;
        while i < lower.len() {
            assert!(
                cased[i].to_ascii_lowercase() == lower[i],
                "case is not the same name"
            );
            i += 1;
        }
        StaticHeaderName {
            name: HeaderName::from_static(name),
            case,
        }
    }

    /// A name sent as written, in lowercase.
    pub const fn from_static(name: &'static str) -> Self {
        Self::new(name, name)
    }

    /// The name the header maps are keyed by.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl IntoCaseHeaderName for &StaticHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(Bytes::from_static(self.case.as_bytes()))
    }

    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        Ok((self.name.clone(), self.into_case_header_name()))
    }
}

impl IntoCaseHeaderName for CaseHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        self
    }
}

impl IntoCaseHeaderName for String {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self.into())
    }
}

impl IntoCaseHeaderName for &'static str {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self.into())
    }
}

impl IntoCaseHeaderName for HeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(titled_header_name(&self))
    }

    // PATCH (sluice, prebuilt header names): already parsed.
    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        let case = CaseHeaderName(titled_header_name(&self));
        Ok((self, case))
    }
}

impl IntoCaseHeaderName for &HeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(titled_header_name(self))
    }

    // PATCH (sluice, prebuilt header names): already parsed.
    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        let case = CaseHeaderName(titled_header_name(self));
        Ok((self.clone(), case))
    }
}

impl IntoCaseHeaderName for Bytes {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self)
    }
}

fn titled_header_name(header_name: &HeaderName) -> Bytes {
    titled_header_name_str(header_name).map_or_else(
        || Bytes::copy_from_slice(header_name.as_str().as_bytes()),
        |s| Bytes::from_static(s.as_bytes()),
    )
}

pub(crate) fn titled_header_name_str(header_name: &HeaderName) -> Option<&'static str> {
    Some(match *header_name {
        header::ACCEPT_RANGES => "Accept-Ranges",
        header::AGE => "Age",
        header::CACHE_CONTROL => "Cache-Control",
        header::CONNECTION => "Connection",
        header::CONTENT_TYPE => "Content-Type",
        header::CONTENT_ENCODING => "Content-Encoding",
        header::CONTENT_LENGTH => "Content-Length",
        header::DATE => "Date",
        header::TRANSFER_ENCODING => "Transfer-Encoding",
        header::HOST => "Host",
        header::SERVER => "Server",
        header::SET_COOKIE => "Set-Cookie",
        // TODO: add more const header here to map to their titled case
        // TODO: automatically upper case the first letter?
        _ => {
            return None;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_case_header_name() {
        assert_eq!("FoO".into_case_header_name().as_slice(), b"FoO");
        assert_eq!("FoO".to_string().into_case_header_name().as_slice(), b"FoO");
        assert_eq!(header::SERVER.into_case_header_name().as_slice(), b"Server");
    }

    // PATCH (sluice, prebuilt header names)
    #[test]
    fn prebuilt_names_keep_their_case_and_key() {
        static X_ID: StaticHeaderName = StaticHeaderName::new("x-id", "X-Id");
        let (name, case) = (&X_ID).into_header_names().unwrap();
        assert_eq!((name.as_str(), case.as_slice()), ("x-id", &b"X-Id"[..]));
        let (name, case) = header::HOST.into_header_names().unwrap();
        assert_eq!((name, case.as_slice()), (header::HOST, &b"Host"[..]));
        let (name, case) = HeaderName::from_static("x-low")
            .into_header_names()
            .unwrap();
        assert_eq!((name.as_str(), case.as_slice()), ("x-low", &b"x-low"[..]));
        let (name, case) = "X-Parsed".into_header_names().unwrap();
        assert_eq!(
            (name.as_str(), case.as_slice()),
            ("x-parsed", &b"X-Parsed"[..])
        );
        assert!("bad name".into_header_names().is_err());
    }

    #[test]
    #[should_panic(expected = "case is not the same name")]
    fn a_case_of_another_name_is_refused() {
        let _ = StaticHeaderName::new("x-id", "X-Ix");
    }
}
