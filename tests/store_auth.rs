//! Store authentication (`FERROCCL_STORE_SECRET`, `store::auth`): a server with a
//! secret serves only clients that answer its challenge; strangers — no secret, a wrong
//! one, PyTorch's protocol, garbage — are disconnected without reading or changing a key,
//! and the clients that belong keep working.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ferroccl::store::auth::StoreSecret;
use ferroccl::store::wire::{QueryType, VALIDATION_MAGIC, Writer};
use ferroccl::store::{ServerOptions, Store, TcpStore, TcpStoreOptions, TcpStoreServer};

fn server(secret: Option<&[u8]>) -> TcpStoreServer {
    let options = ServerOptions {
        secret: secret.map(StoreSecret::new),
        ..ServerOptions::default()
    };
    TcpStoreServer::bind("127.0.0.1:0", options).unwrap()
}

fn client(addr: &str, secret: Option<&[u8]>) -> ferroccl::Result<TcpStore> {
    TcpStore::connect(
        addr,
        TcpStoreOptions {
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_millis(500),
            secret: secret.map(StoreSecret::new),
        },
    )
}

/// Sends `bytes` on a raw connection and returns what comes back before the server
/// closes it (or a second passes).
fn stranger(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let _ = s.write_all(bytes);
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got
}

#[test]
fn only_clients_with_the_secret_are_served() {
    let srv = server(Some(b"job-42-secret"));
    let addr = srv.local_addr().to_string();
    let member = client(&addr, Some(b"job-42-secret")).unwrap();
    member.set("k", b"v").unwrap();

    let e = client(&addr, None).unwrap_err().to_string();
    assert!(e.contains("FERROCCL_STORE_SECRET"), "{e}");
    let e = client(&addr, Some(b"another job")).unwrap_err().to_string();
    assert!(e.contains("refused this secret"), "{e}");

    // Strangers on the raw port: PyTorch's handshake then a SET, a GET, an AUTH_PROOF
    // without a challenge, a wrong proof after a real challenge, and garbage.
    let mut torch_like = Writer::request(QueryType::Validate);
    torch_like
        .u32(VALIDATION_MAGIC)
        .u8(QueryType::Set as u8)
        .bytes(b"/k")
        .bytes(b"evil");
    let mut get = Writer::request(QueryType::Validate);
    get.u32(VALIDATION_MAGIC)
        .u8(QueryType::Get as u8)
        .bytes(b"/k");
    let mut proof_first = Writer::request(QueryType::Validate);
    proof_first
        .u32(VALIDATION_MAGIC)
        .u8(QueryType::AuthProof as u8)
        .bytes(&[0; 32]);
    let mut wrong_proof = Writer::request(QueryType::Validate);
    wrong_proof
        .u32(VALIDATION_MAGIC)
        .u8(QueryType::AuthHello as u8)
        .u8(QueryType::AuthProof as u8)
        .bytes(&[7; 32]);
    for (what, bytes) in [
        ("torch-like SET", torch_like.into_vec()),
        ("GET", get.into_vec()),
        ("proof without challenge", proof_first.into_vec()),
        ("wrong proof", wrong_proof.into_vec()),
        ("garbage", vec![0xff; 100]),
    ] {
        let answer = stranger(&addr, &bytes);
        // At most the challenge (8-byte length + 32 bytes) comes back; never a value.
        assert!(
            answer.len() <= 40,
            "{what}: got {} bytes back",
            answer.len()
        );
        assert!(
            !answer.windows(4).any(|w| w == b"evil" || w == b"v\0\0\0"),
            "{what}"
        );
    }
    // Nothing changed, and the member still works on its connection and a new one.
    assert_eq!(member.get("k").unwrap(), b"v");
    assert_eq!(member.num_keys().unwrap(), 1);
    let again = client(&addr, Some(b"job-42-secret")).unwrap();
    assert_eq!(again.add("n", 3).unwrap(), 3);
}

#[test]
fn a_client_with_a_secret_talks_to_a_server_without_one() {
    let srv = server(None);
    let addr = srv.local_addr().to_string();
    let c = client(&addr, Some(b"s")).unwrap();
    c.set("a", b"1").unwrap();
    assert_eq!(client(&addr, None).unwrap().get("a").unwrap(), b"1");
}
