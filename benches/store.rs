//! Control-plane latency: one `set`, `get`, `add` and `check` round trip on each store.
//!
//! The bootstrap of an n-rank job costs a few of these per rank, so this is what start-up
//! time is made of. Run with `cargo bench --bench store`.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use ferroccl::store::{FileStore, HashStore, ServerOptions, Store, TcpStore, TcpStoreOptions};

fn bench_store(c: &mut Criterion, name: &str, store: Arc<dyn Store>) {
    let mut group = c.benchmark_group(name);
    let value = vec![7u8; 64];
    store.set("key", &value).unwrap();
    group.bench_function("set 64 B", |b| b.iter(|| store.set("key", &value).unwrap()));
    group.bench_function("get 64 B", |b| b.iter(|| store.get("key").unwrap()));
    group.bench_function("add", |b| b.iter(|| store.add("counter", 1).unwrap()));
    group.bench_function("check", |b| b.iter(|| store.check(&["key"]).unwrap()));
    group.finish();
}

fn stores(c: &mut Criterion) {
    bench_store(c, "hash_store", Arc::new(HashStore::new()));
    let tcp = TcpStore::host(
        "127.0.0.1:0",
        ServerOptions::default(),
        TcpStoreOptions::default(),
    )
    .unwrap();
    bench_store(c, "tcp_store_loopback", Arc::new(tcp));
    let dir = tempfile::tempdir().unwrap();
    let file = FileStore::open(dir.path().join("store")).unwrap();
    bench_store(c, "file_store_tmp", Arc::new(file));
}

criterion_group!(benches, stores);
criterion_main!(benches);
