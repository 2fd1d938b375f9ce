//! Decoding a compressed body (`Content-Encoding` gzip, deflate, br, zstd) into a sink as the
//! body streams by, for scanning only: the client gets the member's bytes.
//!
//! The decoders write into the sink in bounded pieces, so a sink that refuses bytes past its
//! bound stops a zip bomb there. Their own state is bounded by their formats: 32 KiB for
//! deflate, brotli's window (at most 16 MiB), and zstd's, held to 8 MiB.

use std::io::{self, Write};

/// A `Content-Encoding` this module does not decode, or two stacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnknownCoding;

/// A body's way into a sink: as it is, or through a decoder.
pub(crate) enum Tap<W: Write> {
    Plain(W),
    Gzip(Box<flate2::write::MultiGzDecoder<W>>),
    /// `deflate` is zlib-wrapped by the standard and raw in some servers: its first two bytes
    /// tell which.
    DeflateHead(W, [u8; 2], usize),
    Zlib(Box<flate2::write::ZlibDecoder<W>>),
    RawDeflate(Box<flate2::write::DeflateDecoder<W>>),
    Brotli(Box<brotli_decompressor::DecompressorWriter<W>>),
    Zstd(Box<zstd::stream::write::Decoder<'static, W>>),
    /// Only while the deflate head is being replaced.
    Switching,
}

/// zstd's window, at most: 8 MiB, the most the HTTP content coding allows (RFC 9659).
const ZSTD_WINDOW_LOG_MAX: u32 = 23;
/// Bytes brotli decodes into before handing them on.
const BROTLI_BUFFER: usize = 4096;

impl<W: Write> Tap<W> {
    /// The tap for a body with `headers`, into `sink`; `Err` for a coding it does not decode
    /// (or two stacked).
    pub(crate) fn new(sink: W, headers: &http::HeaderMap) -> Result<Tap<W>, UnknownCoding> {
        let mut codings = headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .flat_map(|v| v.to_str().unwrap_or("?").split(','))
            .map(str::trim)
            .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"));
        let coding = codings.next();
        if codings.next().is_some() {
            // Stacked codings: rare enough not to decode.
            return Err(UnknownCoding);
        }
        let Some(coding) = coding else {
            return Ok(Tap::Plain(sink));
        };
        let is = |name: &str| coding.eq_ignore_ascii_case(name);
        if is("gzip") || is("x-gzip") {
            Ok(Tap::Gzip(Box::new(flate2::write::MultiGzDecoder::new(
                sink,
            ))))
        } else if is("deflate") {
            Ok(Tap::DeflateHead(sink, [0; 2], 0))
        } else if is("br") {
            Ok(Tap::Brotli(Box::new(
                brotli_decompressor::DecompressorWriter::new(sink, BROTLI_BUFFER),
            )))
        } else if is("zstd") {
            let mut decoder = zstd::stream::raw::Decoder::new().map_err(|_| UnknownCoding)?;
            decoder
                .set_parameter(zstd::stream::raw::DParameter::WindowLogMax(
                    ZSTD_WINDOW_LOG_MAX,
                ))
                .map_err(|_| UnknownCoding)?;
            Ok(Tap::Zstd(Box::new(
                zstd::stream::write::Decoder::with_decoder(sink, decoder),
            )))
        } else {
            Err(UnknownCoding)
        }
    }

    /// Where the decoded bytes go.
    pub(crate) fn sink(&self) -> &W {
        match self {
            Tap::Plain(s) | Tap::DeflateHead(s, ..) => s,
            Tap::Gzip(d) => d.get_ref(),
            Tap::Zlib(d) => d.get_ref(),
            Tap::RawDeflate(d) => d.get_ref(),
            Tap::Brotli(d) => d.get_ref(),
            Tap::Zstd(d) => d.get_ref(),
            Tap::Switching => unreachable!("the deflate head is replaced within one call"),
        }
    }

    /// Decodes `chunk` into the sink; an error from the sink or from a body that does not
    /// decode.
    pub(crate) fn write_all(&mut self, mut chunk: &[u8]) -> io::Result<()> {
        if let Tap::DeflateHead(_, head, len) = self {
            let take = (head.len() - *len).min(chunk.len());
            head[*len..*len + take].copy_from_slice(&chunk[..take]);
            *len += take;
            chunk = &chunk[take..];
            if *len < head.len() {
                return Ok(());
            }
            let Tap::DeflateHead(sink, head, _) = std::mem::replace(self, Tap::Switching) else {
                unreachable!("matched above")
            };
            // A zlib header: method 8 (deflate) and a check making the pair a multiple of 31.
            let zlib =
                head[0] & 0x0F == 8 && (u16::from(head[0]) << 8 | u16::from(head[1])) % 31 == 0;
            *self = if zlib {
                Tap::Zlib(Box::new(flate2::write::ZlibDecoder::new(sink)))
            } else {
                Tap::RawDeflate(Box::new(flate2::write::DeflateDecoder::new(sink)))
            };
            self.write_all(&head)?;
        }
        match self {
            Tap::Plain(s) => s.write_all(chunk),
            Tap::Gzip(d) => d.write_all(chunk),
            Tap::Zlib(d) => d.write_all(chunk),
            Tap::RawDeflate(d) => d.write_all(chunk),
            Tap::Brotli(d) => d.write_all(chunk),
            Tap::Zstd(d) => d.write_all(chunk),
            Tap::DeflateHead(..) | Tap::Switching => Ok(()),
        }
    }

    /// Hands the decoder's last bytes on; an error when the compressed body ended early.
    pub(crate) fn finish(&mut self) -> io::Result<()> {
        match self {
            Tap::Plain(_) | Tap::Switching => Ok(()),
            Tap::DeflateHead(_, _, 0) => Ok(()),
            Tap::DeflateHead(..) => Err(io::ErrorKind::UnexpectedEof.into()),
            Tap::Gzip(d) => d.try_finish(),
            Tap::Zlib(d) => d.try_finish(),
            Tap::RawDeflate(d) => d.try_finish(),
            Tap::Brotli(d) => d.close(),
            Tap::Zstd(d) => d.do_finish(),
        }
    }
}
