//! Wire compatibility with PyTorch's TCPStore, both ways: a `torch.distributed.TCPStore`
//! client against ferroccl's server, and ferroccl's client against PyTorch's (libuv)
//! server. Values written by one side are read back by the other.
//!
//! Runs PyTorch from the test virtualenv (`target/pyenv`, provisioned as for
//! `tests/python.rs`), or the interpreter `FERROCCL_TEST_PYTHON` names.

mod pyenv;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferroccl::Error;
use ferroccl::store::{ServerOptions, Store, TcpStore, TcpStoreOptions, TcpStoreServer};

/// A Python with torch: `FERROCCL_TEST_PYTHON`, else the test virtualenv (made once per
/// test binary; a machine that cannot reach the package registry fails here).
fn python() -> String {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            std::env::var("FERROCCL_TEST_PYTHON").unwrap_or_else(|_| {
                pyenv::provision()
                    .join("bin/python")
                    .to_string_lossy()
                    .into_owned()
            })
        })
        .clone()
}

fn client(addr: &str) -> TcpStore {
    TcpStore::connect(
        addr,
        TcpStoreOptions {
            timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The torch client's side of `torch_client_talks_to_ferroccl_server`.
const TORCH_CLIENT: &str = r#"
import sys, datetime
import torch.distributed as dist
s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                  timeout=datetime.timedelta(seconds=20))
assert s.get("rs/hello") == b"from ferroccl", s.get("rs/hello")
assert s.get("rs/bin") == bytes(range(256))
s.set("py/hello", "from torch")
s.set("py/big", b"x" * (1 << 20))
assert s.add("py/counter", 5) == 5
assert s.add("py/counter", -2) == 3
assert s.add("rs/counter", 10) == 17          # ferroccl added 7 first
assert s.compare_set("py/cas", "", "v1") == b"v1"
assert s.compare_set("py/cas", "nope", "v2") == b"v1"
assert s.compare_set("py/cas", "v1", "v2") == b"v2"
assert s.check(["py/hello", "rs/hello"])
assert not s.check(["py/never"])
s.wait(["rs/hello"], datetime.timedelta(seconds=5))
try:
    s.wait(["py/never"], datetime.timedelta(milliseconds=300))
    raise SystemExit("wait on a missing key did not time out")
except RuntimeError as e:   # DistStoreError
    pass
s.set("py/after-timeout", "still works")
s.multi_set(["py/m1", "py/m2"], ["a", b"b"])
assert s.multi_get(["py/m1", "py/m2", "rs/hello"]) == [b"a", b"b", b"from ferroccl"]
s.append("py/app", "x"); s.append("py/app", "y")
assert s.get("py/app") == b"xy"
s.set("py/gone", "1")
assert s.delete_key("py/gone")
assert not s.delete_key("py/gone")
print("num_keys", s.num_keys(), flush=True)
s.set("py/done", "1")
print("TORCH CLIENT OK", flush=True)
"#;

#[test]
fn torch_client_talks_to_ferroccl_server() {
    let py = python();
    let server = TcpStoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap();
    let addr = server.local_addr().to_string();
    let rs = client(&addr);
    rs.set("rs/hello", b"from ferroccl").unwrap();
    rs.set("rs/bin", &(0..=255).collect::<Vec<u8>>()).unwrap();
    assert_eq!(rs.add("rs/counter", 7).unwrap(), 7);

    let out = Command::new(&py)
        .args([
            "-c",
            TORCH_CLIENT,
            "127.0.0.1",
            &server.local_addr().port().to_string(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("TORCH CLIENT OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What torch wrote, read by ferroccl's client.
    assert_eq!(rs.get("py/hello").unwrap(), b"from torch");
    assert_eq!(rs.get("py/big").unwrap(), vec![b'x'; 1 << 20]);
    assert_eq!(rs.get("py/counter").unwrap(), b"3");
    assert_eq!(rs.get("rs/counter").unwrap(), b"17");
    assert_eq!(rs.get("py/cas").unwrap(), b"v2");
    assert_eq!(rs.get("py/app").unwrap(), b"xy");
    assert_eq!(rs.get("py/after-timeout").unwrap(), b"still works");
    assert!(!rs.check(&["py/gone"]).unwrap());
    // Keys seen by the server, counted by both clients alike.
    let torch_count: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("num_keys "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(rs.num_keys().unwrap(), torch_count + 1); // + py/done
}

/// A torch (libuv) server: prints its port, waits for ferroccl's client to finish, then
/// checks what it wrote.
const TORCH_SERVER: &str = r#"
import datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=30), use_libuv=True)
s.set("py/hello", "from torch")
print(s.port, flush=True)
s.wait(["rs/done"], datetime.timedelta(seconds=30))
assert s.get("rs/hello") == b"from ferroccl"
assert s.get("rs/bin") == bytes(range(256))
assert s.get("rs/counter") == b"40"
assert s.get("rs/cas") == b"new"
assert s.multi_get(["rs/m1", "rs/m2"]) == [b"one", b"two"]
assert s.get("rs/app") == b"abc"
assert not s.check(["rs/deleted"])
print("TORCH SERVER OK", flush=True)
"#;

#[test]
fn ferroccl_client_talks_to_torch_server() {
    let py = python();
    let mut child = Command::new(&py)
        .args(["-c", TORCH_SERVER])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut port = String::new();
    stdout.read_line(&mut port).unwrap();
    let port: u16 = port.trim().parse().expect("torch server printed its port");
    let rs: Arc<dyn Store> = Arc::new(client(&format!("127.0.0.1:{port}")));

    assert_eq!(rs.get("py/hello").unwrap(), b"from torch");
    rs.set("rs/hello", b"from ferroccl").unwrap();
    rs.set("rs/bin", &(0..=255).collect::<Vec<u8>>()).unwrap();
    rs.set("rs/big", &vec![b'y'; 1 << 20]).unwrap();
    assert_eq!(rs.get("rs/big").unwrap().len(), 1 << 20);
    rs.set("rs/empty", b"").unwrap();
    assert_eq!(rs.get("rs/empty").unwrap(), b"");
    assert_eq!(rs.add("rs/counter", 42).unwrap(), 42);
    assert_eq!(rs.add("rs/counter", -2).unwrap(), 40);
    assert_eq!(rs.compare_set("rs/cas", b"", b"old").unwrap(), b"old");
    assert_eq!(rs.compare_set("rs/cas", b"x", b"new").unwrap(), b"old");
    assert_eq!(rs.compare_set("rs/cas", b"old", b"new").unwrap(), b"new");
    assert!(rs.check(&["rs/hello", "py/hello"]).unwrap());
    assert!(!rs.check(&["rs/never"]).unwrap());
    // A timed-out wait is cancelled (CANCEL_WAIT) and the connection stays usable.
    match rs.wait(&["rs/never", "rs/hello"], Duration::from_millis(300)) {
        Err(Error::StoreTimeout { missing, .. }) => assert_eq!(missing, ["rs/never"]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    rs.multi_set(&["rs/m1", "rs/m2"], &[b"one", b"two"])
        .unwrap();
    assert_eq!(
        rs.multi_get(&["rs/m1", "rs/m2"]).unwrap(),
        [b"one".to_vec(), b"two".to_vec()]
    );
    rs.append("rs/app", b"a").unwrap();
    rs.append("rs/app", b"bc").unwrap();
    rs.set("rs/deleted", b"1").unwrap();
    assert!(rs.delete("rs/deleted").unwrap());
    assert!(!rs.delete("rs/deleted").unwrap());
    assert!(rs.num_keys().unwrap() >= 10);
    rs.set("rs/done", b"1").unwrap();

    let out = child.wait_with_output().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(
        out.status.success() && rest.contains("TORCH SERVER OK"),
        "{rest}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
