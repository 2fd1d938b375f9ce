//! Benchmarks for response parsing (`parse_redis_value`).
//!
//! These measure the cost of turning a RESP byte buffer into a [`redis::Value`].
//!
//! In addition to wall-clock time, this bench reports the number of heap
//! allocations performed while parsing each payload (via a counting global
//! allocator). Allocation count is deterministic and machine-independent, which
//! makes it the clearest signal of the zero-copy improvement.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use redis::parse_redis_value;

mod common;

use common::{array_header, bulk, simple};

#[global_allocator]
static GLOBAL: common::CountingAllocator = common::CountingAllocator;

/// Builds the set of payloads to benchmark: `(name, encoded bytes)`.
fn payloads() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();

    // A single large bulk string (1 MiB). Old & new both copy ~once here, so
    // this is the "bandwidth bound, not allocation bound" baseline.
    let single_bulk_1mb = {
        let mut v = Vec::new();
        bulk(&mut v, &vec![b'x'; 1024 * 1024]);
        v
    };

    // Many small bulk strings: the old parser allocated one Vec per element.
    let array_5000_small_bulks = {
        let mut v = Vec::new();
        array_header(&mut v, 5000);
        for i in 0..5000 {
            bulk(&mut v, format!("value:{i:08}").as_bytes());
        }
        v
    };

    // Fewer, larger bulk strings (1 KiB each).
    let array_500_1kb_bulks = {
        let mut v = Vec::new();
        array_header(&mut v, 500);
        let chunk = vec![b'y'; 1024];
        for _ in 0..500 {
            bulk(&mut v, &chunk);
        }
        v
    };

    // Many simple strings (old parser allocated a String per element).
    let array_5000_simple_strings = {
        let mut v = Vec::new();
        array_header(&mut v, 5000);
        for i in 0..5000 {
            simple(&mut v, &format!("status:{i:08}"));
        }
        v
    };

    // A key/value reply: 1000 pairs flattened into a 2000-element array.
    let array_1000_kv_pairs = {
        let mut v = Vec::new();
        array_header(&mut v, 2000);
        for i in 0..1000 {
            bulk(&mut v, format!("key:{i:08}").as_bytes());
            bulk(&mut v, format!("val:{i:08}").as_bytes());
        }
        v
    };

    out.push(("single_bulk_1mb", single_bulk_1mb));
    out.push(("array_5000_small_bulks", array_5000_small_bulks));
    out.push(("array_500_1kb_bulks", array_500_1kb_bulks));
    out.push(("array_5000_simple_strings", array_5000_simple_strings));
    out.push(("array_1000_kv_pairs", array_1000_kv_pairs));
    out
}

/// Parses each payload once and reports the number of heap allocations and
/// bytes allocated during parsing. This is deterministic across runs.
fn report_allocations(payloads: &[(&'static str, Vec<u8>)]) {
    println!("\n=== allocations while parsing (lower is better) ===");
    println!(
        "{:<28} {:>12} {:>14}",
        "payload", "allocations", "bytes_alloc'd"
    );
    for (name, bytes) in payloads {
        // Warm up / stabilize, then measure a single parse.
        let _ = parse_redis_value(bytes).unwrap();

        let before = common::alloc_snapshot();
        let value = parse_redis_value(black_box(bytes)).unwrap();
        let (allocs, alloc_bytes) = before.since();
        // Keep `value` alive across the measurement, then drop it afterwards.
        black_box(&value);
        drop(value);

        println!("{name:<28} {allocs:>12} {alloc_bytes:>14}");
    }
    println!();
}

/// A reader that hands out at most `chunk` bytes per `read`, to simulate a
/// reply arriving over many socket reads.
struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl std::io::Read for Chunked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.data.len().min(self.chunk).min(buf.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

fn bench_parse(c: &mut Criterion) {
    let payloads = payloads();
    report_allocations(&payloads);

    let mut group = c.benchmark_group("parse_redis_value");
    for (name, bytes) in &payloads {
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| {
                let value = parse_redis_value(black_box(bytes)).unwrap();
                black_box(value);
            });
        });
    }
    group.finish();
}

/// Parses one large reply that is delivered in small pieces, the way a real
/// socket delivers it.
///
/// This is the case `parse_redis_value` above cannot see: the parser has to
/// resume where it stopped on each read. If it instead restarts from the
/// beginning of the buffer, cost becomes quadratic in the size of the reply and
/// these timings blow up as `chunk` shrinks, while the whole-buffer benchmark
/// stays flat.
fn bench_parse_chunked(c: &mut Criterion) {
    // ~1 MiB array of 5000 small bulk strings.
    let payload = {
        let mut v = Vec::new();
        array_header(&mut v, 5000);
        let data = vec![b'x'; 200];
        for _ in 0..5000 {
            bulk(&mut v, &data);
        }
        v
    };

    let mut group = c.benchmark_group("parse_chunked_1mb_array");
    for chunk in [1024usize, 4 * 1024, 8 * 1024] {
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function(format!("chunk_{chunk}"), |b| {
            b.iter(|| {
                let mut parser = redis::Parser::new();
                let value = parser
                    .parse_value(Chunked {
                        data: black_box(&payload),
                        chunk,
                    })
                    .unwrap();
                black_box(value);
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_parse, bench_parse_chunked);
criterion_main!(benches);
