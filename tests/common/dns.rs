//! A fake DNS server for the tests of DNS-discovered replicas.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// A minimal authoritative DNS server on loopback UDP: SRV answers from `srv` (target, port),
/// A answers 127.0.0.1 for any other name, TTL 1 s. Enough for the resolver, nothing more.
pub async fn fake_dns(srv: Arc<Mutex<Vec<(String, u16)>>>) -> SocketAddr {
    fn put_name(out: &mut Vec<u8>, name: &str) {
        for label in name.trim_end_matches('.').split('.') {
            out.push(label.len() as u8);
            out.extend_from_slice(label.as_bytes());
        }
        out.push(0);
    }
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                return;
            };
            let q = &buf[..n];
            if n < 12 {
                continue;
            }
            // Question: labels, then type and class.
            let mut p = 12;
            while p < n && q[p] != 0 {
                p += q[p] as usize + 1;
            }
            let qend = p + 5;
            if qend > n {
                continue;
            }
            let qtype = u16::from_be_bytes([q[p + 1], q[p + 2]]);
            let mut answers: Vec<Vec<u8>> = Vec::new();
            let rr = |kind: u16, rdata: Vec<u8>| {
                let mut a = vec![0xc0, 0x0c]; // name: pointer to the question
                a.extend_from_slice(&kind.to_be_bytes());
                a.extend_from_slice(&1u16.to_be_bytes());
                a.extend_from_slice(&1u32.to_be_bytes()); // TTL 1 s
                a.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
                a.extend_from_slice(&rdata);
                a
            };
            match qtype {
                33 => {
                    for (target, port) in srv.lock().unwrap().iter() {
                        let mut rd = vec![0, 10, 0, 10];
                        rd.extend_from_slice(&port.to_be_bytes());
                        put_name(&mut rd, target);
                        answers.push(rr(33, rd));
                    }
                }
                1 => answers.push(rr(1, vec![127, 0, 0, 1])),
                _ => {}
            }
            let mut resp = Vec::with_capacity(512);
            resp.extend_from_slice(&q[..2]); // id
            resp.extend_from_slice(&[0x85, 0x80]); // response, authoritative, RD, RA, NOERROR
            resp.extend_from_slice(&1u16.to_be_bytes());
            resp.extend_from_slice(&(answers.len() as u16).to_be_bytes());
            resp.extend_from_slice(&[0, 0, 0, 0]);
            resp.extend_from_slice(&q[12..qend]);
            for a in answers {
                resp.extend_from_slice(&a);
            }
            let _ = sock.send_to(&resp, peer).await;
        }
    });
    addr
}
