//! Server-Sent Events, parsed as they stream by, per the WHATWG rules: lines end in CRLF, LF
//! or CR; a blank line dispatches the event; `data:` lines are joined with LF; a line starting
//! with `:` is a comment; one space after the colon is dropped; a leading BOM is skipped; an
//! event the stream ends in the middle of is not dispatched. Only `data` matters here: the
//! event type, id and retry are read past.
//!
//! A chunk may end anywhere, inside a line ending included. The parser keeps one event's data
//! and never more than `max_event` bytes of it: a larger event is dispatched as
//! [`Event::Oversized`] with its data dropped.

/// A dispatched event.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<'a> {
    /// Its data, the lines joined with LF.
    Data(&'a [u8]),
    /// Its data was longer than the bound.
    Oversized,
}

/// Where in a line the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Nothing of the line yet.
    Start,
    /// In the field name; `name` holds its first bytes.
    Name,
    /// Right after `data:`; a space here is dropped.
    DataColon,
    /// In a `data` value.
    DataValue,
    /// In a comment or a field other than `data`.
    Skip,
}

const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// The parser's state between chunks.
#[derive(Debug)]
pub struct SseParser {
    max_event: usize,
    data: Vec<u8>,
    /// The event's data outgrew `max_event`; `data` was dropped.
    oversized: bool,
    /// The event has had a `data` line (possibly empty).
    has_data: bool,
    line: Line,
    /// The first bytes of a field name: enough to tell `data` from anything else.
    name: [u8; 4],
    name_len: usize,
    /// The last byte was CR: an LF right after it ends nothing more.
    after_cr: bool,
    /// BOM bytes matched at the start of the stream; `None` once past it.
    bom: Option<usize>,
}

impl SseParser {
    /// A parser keeping at most `max_event` bytes of an event's data.
    pub fn new(max_event: usize) -> SseParser {
        SseParser {
            max_event,
            data: Vec::new(),
            oversized: false,
            has_data: false,
            line: Line::Start,
            name: [0; 4],
            name_len: 0,
            after_cr: false,
            bom: Some(0),
        }
    }

    /// Parses `bytes`, the stream's next chunk, calling `on_event` for each event it completes.
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(Event<'_>)) {
        let mut i = 0;
        while i < bytes.len() {
            if let Some(matched) = self.bom {
                if bytes[i] == BOM[matched] {
                    i += 1;
                    self.bom = (matched + 1 < BOM.len()).then_some(matched + 1);
                    continue;
                }
                // Not a BOM. The bytes of a broken one decode to U+FFFD, which begins a field
                // name that is not `data`: the line is read past.
                self.bom = None;
                if matched > 0 {
                    self.line = Line::Skip;
                }
            }
            let b = bytes[i];
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    i += 1;
                    continue;
                }
            }
            if b == b'\r' || b == b'\n' {
                self.after_cr = b == b'\r';
                self.end_line(&mut on_event);
                i += 1;
                continue;
            }
            match self.line {
                Line::Start if b == b':' => {
                    self.line = Line::Skip;
                    i += 1;
                }
                Line::Start | Line::Name => {
                    if b == b':' {
                        self.line = if self.is_data() {
                            Line::DataColon
                        } else {
                            Line::Skip
                        };
                    } else if self.name_len == self.name.len() {
                        // Longer than `data`: a field read past, or a line without a colon,
                        // which is one too. Skipping it finds its end at memchr's pace, so a
                        // huge line costs little.
                        self.line = Line::Skip;
                    } else {
                        self.line = Line::Name;
                        self.name[self.name_len] = b;
                        self.name_len += 1;
                    }
                    i += 1;
                }
                Line::DataColon => {
                    self.line = Line::DataValue;
                    self.has_data = true;
                    if b == b' ' {
                        i += 1;
                    }
                }
                Line::DataValue | Line::Skip => {
                    // The rest of the line at once, up to its end.
                    let end =
                        memchr::memchr2(b'\r', b'\n', &bytes[i..]).map_or(bytes.len(), |n| i + n);
                    if self.line == Line::DataValue {
                        self.push(&bytes[i..end]);
                    }
                    i = end;
                }
            }
        }
    }

    fn is_data(&self) -> bool {
        self.name_len == 4 && self.name == *b"data"
    }

    fn end_line(&mut self, on_event: &mut impl FnMut(Event<'_>)) {
        match self.line {
            Line::Start => self.dispatch(on_event),
            // A line without a colon is a field with an empty value.
            Line::Name if self.is_data() => {
                self.has_data = true;
                self.push(b"\n");
            }
            Line::DataColon | Line::DataValue => {
                self.has_data = true;
                self.push(b"\n");
            }
            Line::Name | Line::Skip => {}
        }
        self.line = Line::Start;
        self.name_len = 0;
    }

    fn push(&mut self, bytes: &[u8]) {
        if self.oversized {
            return;
        }
        // Every data line ends in an LF that the last one drops: the bound is on the data.
        let bound = self.max_event.saturating_add(1);
        if self.data.len() + bytes.len() > bound {
            self.oversized = true;
            self.data.clear();
            return;
        }
        if self.data.capacity() < self.data.len() + bytes.len() {
            // Grow by doubling, but never past the bound.
            let want = (self.data.capacity() * 2)
                .max(self.data.len() + bytes.len())
                .max(64)
                .min(bound);
            self.data.reserve_exact(want - self.data.len());
        }
        self.data.extend_from_slice(bytes);
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(Event<'_>)) {
        if self.oversized {
            on_event(Event::Oversized);
        } else if self.has_data {
            // Every data line added an LF; the last one is not part of the data.
            let end = self.data.len().saturating_sub(1);
            on_event(Event::Data(&self.data[..end]));
        }
        self.data.clear();
        self.oversized = false;
        self.has_data = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every event of `stream` fed in `chunks`, as text ("<oversized>" for one too large).
    fn events(stream: &[u8], max: usize, cuts: &[usize]) -> Vec<String> {
        let mut parser = SseParser::new(max);
        let mut out = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
            let cut = cut.clamp(from, stream.len());
            parser.feed(&stream[from..cut], |e| {
                out.push(match e {
                    Event::Data(d) => String::from_utf8_lossy(d).into_owned(),
                    Event::Oversized => "<oversized>".to_string(),
                })
            });
            from = cut;
        }
        out
    }

    #[test]
    fn the_whatwg_rules() {
        let stream = b"\xEF\xBB\xBFdata: a\r\ndata:b\r\rdata\n\n: comment\nevent: x\nid: 1\nretry: 5\ndata:  two spaces\n\ndatax: no\ndata\r\n\r\nno-colon\n\ndata: cut";
        assert_eq!(
            events(stream, 1024, &[]),
            ["a\nb", "", " two spaces", ""],
            "the last event has no blank line after it and is not dispatched"
        );
        // A BOM that breaks off decodes to U+FFFD, which starts a field that is not `data`.
        assert!(events(b"\xEF\xBBdata: x\n\n", 1024, &[]).is_empty());
        assert!(events(b"\xEFdata: x\n\n", 1024, &[]).is_empty());
        // Lines without data dispatch nothing.
        assert!(events(b"event: ping\n\n: keepalive\n\n\n\n", 1024, &[]).is_empty());
    }

    #[test]
    fn an_event_past_the_bound_is_oversized_and_the_next_one_is_whole() {
        let stream = b"data: 0123456789A\n\ndata: 01234\ndata: 56789\n\ndata: ok\n\n";
        assert_eq!(
            events(stream, 10, &[]),
            ["<oversized>", "<oversized>", "ok"]
        );
        assert_eq!(events(b"data: 0123456789\n\n", 10, &[]), ["0123456789"]);
    }

    #[test]
    fn a_cr_lf_split_across_chunks_ends_one_line() {
        let stream = b"data: a\r\n\r\ndata: b\r\n\r\n";
        for cut in 0..=stream.len() {
            assert_eq!(events(stream, 64, &[cut]), ["a", "b"], "cut at {cut}");
        }
    }

    /// The rules read literally: the whole stream split into lines first, then each line.
    fn reference(stream: &[u8], max: usize) -> Vec<String> {
        let stream = stream.strip_prefix(&BOM[..]).unwrap_or(stream);
        let mut lines = Vec::new();
        let mut start = 0;
        let mut i = 0;
        while i < stream.len() {
            match stream[i] {
                b'\n' => {
                    lines.push(&stream[start..i]);
                    start = i + 1;
                }
                b'\r' => {
                    lines.push(&stream[start..i]);
                    if stream.get(i + 1) == Some(&b'\n') {
                        i += 1;
                    }
                    start = i + 1;
                }
                _ => {}
            }
            i += 1;
        }
        // What follows the last line end is no line yet: the stream ended inside it.
        let mut out = Vec::new();
        let mut data: Option<Vec<u8>> = None;
        for line in lines {
            if line.is_empty() {
                if let Some(mut d) = data.take() {
                    d.pop();
                    out.push(if d.len() > max {
                        "<oversized>".to_string()
                    } else {
                        String::from_utf8_lossy(&d).into_owned()
                    });
                }
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (name, value) = match line.iter().position(|b| *b == b':') {
                Some(at) => (&line[..at], &line[at + 1..]),
                None => (line, &b""[..]),
            };
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if name == b"data" {
                let d = data.get_or_insert_with(Vec::new);
                d.extend_from_slice(value);
                d.push(b'\n');
            }
        }
        out
    }

    proptest! {
        /// The streaming parser, fed in any cuts, agrees with the rules read literally.
        #[test]
        fn agrees_with_the_rules_read_literally(
            stream in proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' '), Just(b'd'), Just(b'a'),
                    Just(b't'), Just(b'x'), Just(0xEF), Just(0xBB), Just(0xBF), any::<u8>()
                ],
                0..200,
            ),
            mut cuts in proptest::collection::vec(0usize..200, 0..8),
            max in 1usize..40,
        ) {
            cuts.sort_unstable();
            prop_assert_eq!(events(&stream, max, &cuts), reference(&stream, max));
        }

        /// Streams made of real field lines, where the alphabet above rarely spells `data`.
        #[test]
        fn agrees_on_well_formed_lines(
            lines in proptest::collection::vec(
                (
                    prop_oneof![Just("data"), Just("data"), Just("event"), Just(""), Just("id"), Just("dat"), Just("datas")],
                    prop_oneof![Just(":"), Just(": "), Just(":  "), Just("")],
                    "[a-z {}\":]{0,12}",
                    prop_oneof![Just("\n"), Just("\r\n"), Just("\r"), Just("\n\n"), Just("\r\n\r\n")],
                ),
                0..20,
            ),
            bom in 0usize..4,
            mut cuts in proptest::collection::vec(0usize..400, 0..8),
            max in 1usize..40,
        ) {
            // None, the start of a BOM that breaks off, or a whole one.
            let mut stream = BOM[..bom].to_vec();
            for (name, colon, value, eol) in &lines {
                stream.extend_from_slice(name.as_bytes());
                stream.extend_from_slice(colon.as_bytes());
                stream.extend_from_slice(value.as_bytes());
                stream.extend_from_slice(eol.as_bytes());
            }
            cuts.sort_unstable();
            prop_assert_eq!(events(&stream, max, &cuts), reference(&stream, max));
        }

        /// Any stream, cut anywhere into any number of chunks, gives the events it gives whole.
        #[test]
        fn splits_change_nothing(
            stream in proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' '), Just(b'd'), Just(b'a'),
                    Just(b't'), Just(b'x'), Just(0xEF), Just(0xBB), Just(0xBF), any::<u8>()
                ],
                0..200,
            ),
            mut cuts in proptest::collection::vec(0usize..200, 0..8),
            max in 1usize..40,
        ) {
            cuts.sort_unstable();
            let whole = events(&stream, max, &[]);
            prop_assert_eq!(&events(&stream, max, &cuts), &whole);
            let bytewise: Vec<usize> = (0..stream.len()).collect();
            prop_assert_eq!(&events(&stream, max, &bytewise), &whole);
        }
    }
}
