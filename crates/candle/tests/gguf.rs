//! `kvq_candle::gguf::check`: GGUF files crafted one lie at a time, each refused with a clear
//! error before candle's parser reads it, and the honest ones accepted.

mod common;

use std::io::Cursor;

use common::*;
use kvq_candle::gguf::check;
use kvq_candle::{Error, LlamaModel};

/// A metadata value: its GGUF type and little-endian bytes.
struct Kv(&'static str, u32, Vec<u8>);

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

fn u32v(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// A tensor entry: name, dims (GGUF order: row length first), type, offset.
struct T(&'static str, Vec<u64>, u32, u64);

/// A GGUF of `version` with these entries, tensor data of `data` zero bytes after the header
/// padded to 32.
fn gguf(version: u32, kvs: &[Kv], tensors: &[T], data: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for Kv(k, ty, v) in kvs {
        b.extend_from_slice(&string(k));
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(v);
    }
    for T(name, dims, ty, offset) in tensors {
        b.extend_from_slice(&string(name));
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
    }
    b.resize(b.len().next_multiple_of(32) + data, 0);
    b
}

fn arch() -> Vec<Kv> {
    vec![Kv("general.architecture", 8, string("llama")), Kv("llama.block_count", 4, u32v(2))]
}

/// Two blocks of one F32 tensor each (32 values, 128 bytes).
fn blocks() -> Vec<T> {
    vec![T("blk.0.w", vec![32], 0, 0), T("blk.1.w", vec![32], 0, 128)]
}

fn refused(bytes: &[u8], want: &str) {
    match check(&mut Cursor::new(bytes), bytes.len() as u64) {
        Err(Error::Model { reason, .. }) => assert!(reason.contains(want), "{want:?} not in {reason:?}"),
        other => panic!("expected an error with {want:?}, got {other:?}"),
    }
}

#[test]
fn honest_files_pass() {
    let ok = gguf(3, &arch(), &blocks(), 256);
    let s = check(&mut Cursor::new(&ok), ok.len() as u64).unwrap();
    assert_eq!((s.version, s.alignment, s.tensors, s.data_bytes), (3, 32, 2, 256));
    assert_eq!(s.architecture.as_deref(), Some("llama"));
    // The tiny model candle's writer produces, and with it a model loads.
    let dir = temp_dir("gguf-ok");
    let path = tiny_in(&dir, "llama", kvq_candle::tiny::TinyModel::default().types, 1);
    let bytes = std::fs::read(&path).unwrap();
    check(&mut Cursor::new(&bytes), bytes.len() as u64).unwrap();
    LlamaModel::load(&path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn header_lies_are_refused() {
    let mut swapped = gguf(3, &arch(), &blocks(), 256);
    swapped[4..8].copy_from_slice(&3u32.to_be_bytes());
    refused(&swapped, "big-endian");
    refused(&gguf(1, &arch(), &blocks(), 256), "version 1");
    refused(b"GGUB\x03\0\0\0", "not a GGUF");
    refused(b"GGUF\x03\0\0", "truncated");
    let mut many = gguf(3, &arch(), &blocks(), 256);
    many[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    refused(&many, "tensors declared");
    let mut kvs = gguf(3, &arch(), &blocks(), 256);
    kvs[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    refused(&kvs, "metadata entries declared");
}

#[test]
fn metadata_lies_are_refused() {
    let with = |extra: Kv| {
        let mut kvs = arch();
        kvs.push(extra);
        gguf(3, &kvs, &blocks(), 256)
    };
    refused(&with(Kv("general.alignment", 4, u32v(24))), "power of two");
    refused(&with(Kv("general.alignment", 10, 64u64.to_le_bytes().to_vec())), "power of two");
    refused(&with(Kv("general.alignment", 4, u32v(0))), "power of two");
    refused(&with(Kv("x.string", 8, (1u64 << 50).to_le_bytes().to_vec())), "a string of");
    let mut huge_array = u32v(4);
    huge_array.extend_from_slice(&(1u64 << 60).to_le_bytes());
    refused(&with(Kv("x.array", 9, huge_array)), "an array of");
    // Arrays of arrays of arrays.
    let mut deep = u32v(9);
    deep.extend_from_slice(&1u64.to_le_bytes());
    deep.extend_from_slice(&u32v(9));
    deep.extend_from_slice(&1u64.to_le_bytes());
    deep.extend_from_slice(&u32v(9));
    deep.extend_from_slice(&1u64.to_le_bytes());
    deep.extend_from_slice(&u32v(4));
    deep.extend_from_slice(&1u64.to_le_bytes());
    deep.extend_from_slice(&u32v(7));
    refused(&with(Kv("x.deep", 9, deep)), "nested");
    refused(&with(Kv("x.unknown", 77, vec![0; 8])), "unknown metadata type 77");
    refused(&with(Kv("general.architecture", 8, string("llama"))), "appears twice");
}

#[test]
fn tensor_lies_are_refused() {
    let t = |ts: Vec<T>| gguf(3, &arch(), &ts, 256);
    refused(&t(vec![T("blk.0.w", vec![32], 99, 0), T("blk.1.w", vec![32], 0, 128)]), "unknown type 99");
    refused(
        &t(vec![T("blk.0.w", vec![32, 1, 1, 1, 1], 0, 0), T("blk.1.w", vec![32], 0, 128)]),
        "5 dimensions",
    );
    refused(&t(vec![T("blk.0.w", vec![32, 0], 0, 0), T("blk.1.w", vec![32], 0, 128)]), "a dimension of 0");
    let overflow = vec![1 << 32, 1 << 32, 1 << 8];
    refused(&t(vec![T("blk.0.w", overflow, 0, 0), T("blk.1.w", vec![32], 0, 128)]), "overflow");
    // Q4_0 rows of 40 values are not whole blocks of 32.
    refused(&t(vec![T("blk.0.w", vec![40], 2, 0), T("blk.1.w", vec![32], 0, 128)]), "whole Q4_0 blocks");
    refused(&t(vec![T("blk.0.w", vec![32], 0, 0), T("blk.1.w", vec![32], 0, 96)]), "expected 128");
    refused(&t(vec![T("blk.0.w", vec![32], 0, 0), T("blk.1.w", vec![32], 0, 0)]), "expected 128");
    refused(&t(vec![T("blk.0.w", vec![32], 0, 4), T("blk.1.w", vec![32], 0, 132)]), "expected 0");
    refused(&gguf(3, &arch(), &blocks(), 200), "run past the end");
    refused(&t(vec![T("blk.0.w", vec![32], 0, 0), T("blk.0.w", vec![32], 0, 128)]), "appears twice");
    refused(
        &t(vec![T("blk.0.this-name-is-far-longer-than-the-sixty-three-bytes-ggml-allows", vec![32], 0, 0)]),
        "a string of",
    );
}

#[test]
fn blocks_and_the_vocabulary_must_match_the_metadata() {
    let extra =
        vec![T("blk.0.w", vec![32], 0, 0), T("blk.1.w", vec![32], 0, 128), T("blk.2.w", vec![32], 0, 256)];
    refused(&gguf(3, &arch(), &extra, 384), "past the 2 blocks");
    refused(&gguf(3, &arch(), &[T("blk.0.w", vec![32], 0, 0)], 128), "block 1 of 2 has no tensors");
    let mut kvs = arch();
    let mut tokens = u32v(8);
    tokens.extend_from_slice(&3u64.to_le_bytes());
    for s in ["a", "b", "c"] {
        tokens.extend_from_slice(&string(s));
    }
    kvs.push(Kv("tokenizer.ggml.tokens", 9, tokens));
    let mut ts = blocks();
    ts.push(T("token_embd.weight", vec![32, 4], 0, 256));
    refused(&gguf(3, &kvs, &ts, 256 + 512), "3 tokens, the token embedding 4 rows");
}

#[test]
fn names_from_the_file_are_shown_escaped() {
    let evil = gguf(3, &arch(), &[T("blk.0.\x1b[31mred", vec![32], 99, 0)], 128);
    match check(&mut Cursor::new(&evil), evil.len() as u64) {
        Err(Error::Model { reason, .. }) => {
            assert!(!reason.contains('\x1b'), "{reason:?}");
            assert!(reason.contains("\\u{1b}[31mred"), "{reason:?}");
        }
        other => panic!("{other:?}"),
    }
    // Through the model loader, with the file's name.
    let dir = temp_dir("gguf-evil");
    let path = dir.join("evil.gguf");
    std::fs::write(&path, &evil).unwrap();
    match LlamaModel::load(&path) {
        Err(Error::Model { path: p, reason }) => {
            assert!(p.ends_with("evil.gguf") && reason.contains("unknown type 99"), "{p}: {reason}");
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(dir).unwrap();
}
