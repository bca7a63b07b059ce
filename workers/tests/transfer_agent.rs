//! The KV transfer agent over real loopback sockets: registration, metadata exchange,
//! descriptor reads, notifications, release, bad descriptors, malformed frames, concurrent
//! transfers, and run-time CUDA detection.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_worker::transfer::cuda::{self, CudaStatus};
use kvroute_worker::transfer::frame::{read_frame, Frame, MAX_FRAME_LEN};
use kvroute_worker::transfer::{
    Agent, AgentMetadata, Backend, Descriptor, Memory, PagedRegion, RegionInfo, TransferError,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

struct Pair {
    target: Agent,
    initiator: Agent,
    remote: String,
    host: Bytes,
    host_id: u64,
    paged: Arc<PagedRegion>,
    paged_id: u64,
}

const PAGE: usize = 4096;

async fn pair() -> Pair {
    let target = Agent::new("prefill-agent", Backend::Tcp).unwrap();
    let host = pattern(1 << 20, 7);
    let h = target.register_memory(Memory::Host(host.clone()));
    let paged = Arc::new(PagedRegion::new(8, PAGE as u64));
    for p in 0..6 {
        paged.fill(p, pattern(PAGE, p as u8)).unwrap();
    }
    let ph = target.register_memory(Memory::Paged(paged.clone()));
    let addr = target
        .listen("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let initiator = Agent::new("decode-agent", Backend::Tcp).unwrap();
    let md = initiator
        .fetch_metadata(&addr.to_string())
        .await
        .expect("fetch metadata");
    assert_eq!(md, target.metadata());
    assert_eq!(md.name, "prefill-agent");
    assert_eq!(md.address, addr.to_string());
    assert_eq!(
        md.region(ph.id).map(|r| (r.len, r.page_len)),
        Some(((8 * PAGE) as u64, PAGE as u64))
    );
    let remote = initiator.load_remote(md).unwrap();
    Pair {
        target,
        initiator,
        remote,
        host,
        host_id: h.id,
        paged,
        paged_id: ph.id,
    }
}

#[tokio::test]
async fn register_metadata_read_notify_release() {
    let p = pair().await;
    // Non-adjacent and adjacent host ranges plus pages 1..=3 (three adjacent descriptors that
    // coalesce into one) and a page-crossing range.
    let descs = vec![
        Descriptor {
            region: p.host_id,
            offset: 10,
            len: 100,
        },
        Descriptor {
            region: p.host_id,
            offset: 110,
            len: 50,
        },
        Descriptor {
            region: p.host_id,
            offset: 5000,
            len: 3,
        },
        Descriptor {
            region: p.paged_id,
            offset: PAGE as u64,
            len: PAGE as u64,
        },
        Descriptor {
            region: p.paged_id,
            offset: 2 * PAGE as u64,
            len: PAGE as u64,
        },
        Descriptor {
            region: p.paged_id,
            offset: 3 * PAGE as u64,
            len: PAGE as u64,
        },
        Descriptor {
            region: p.paged_id,
            offset: PAGE as u64 - 5,
            len: 10,
        },
    ];
    let total: u64 = descs.iter().map(|d| d.len).sum();
    let xfer = p
        .initiator
        .read(&p.remote, &descs, vec![0; total as usize])
        .unwrap();
    let out = xfer.wait().await.expect("read");
    assert_eq!(out.bytes, total);
    assert_eq!(out.descriptors, 4, "adjacent descriptors coalesce");
    let mut want = Vec::new();
    want.extend_from_slice(&p.host[10..160]);
    want.extend_from_slice(&p.host[5000..5003]);
    for page in 1..=3 {
        want.extend_from_slice(&p.paged.get(page).unwrap());
    }
    want.extend_from_slice(&p.paged.get(0).unwrap()[PAGE - 5..]);
    want.extend_from_slice(&p.paged.get(1).unwrap()[..5]);
    assert_eq!(out.data, want);
    assert_eq!(p.target.stats().bytes_served, total);
    assert_eq!(p.initiator.stats().bytes_read, total);

    // Completion notification reaches the target.
    let mut notifs = p.target.take_notifications().unwrap();
    assert!(p.target.take_notifications().is_none(), "one consumer");
    p.initiator.notify(&p.remote, b"release:r1").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notifs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.message, b"release:r1");

    // Release: a cleared page and a deregistered region can no longer be read.
    p.paged.clear(2);
    let err = p
        .initiator
        .read(
            &p.remote,
            &[Descriptor {
                region: p.paged_id,
                offset: 2 * PAGE as u64,
                len: 1,
            }],
            vec![0; 1],
        )
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TransferError::Remote(m) if m.contains("not populated")),
        "{err}"
    );
    assert!(p
        .target
        .deregister_memory(&kvroute_worker::transfer::RegionHandle {
            id: p.host_id,
            len: p.host.len() as u64
        }));
    let err = p
        .initiator
        .read(
            &p.remote,
            &[Descriptor {
                region: p.host_id,
                offset: 0,
                len: 8,
            }],
            vec![0; 8],
        )
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TransferError::Remote(m) if m.contains("no region")),
        "{err}"
    );
    // The connection survived the refusals.
    let ok = p
        .initiator
        .read(
            &p.remote,
            &[Descriptor {
                region: p.paged_id,
                offset: 0,
                len: 16,
            }],
            vec![0; 16],
        )
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(ok.data, p.paged.get(0).unwrap()[..16]);
}

#[tokio::test]
async fn bad_descriptors_are_errors() {
    let p = pair().await;
    let read =
        |descs: Vec<Descriptor>, len: usize| p.initiator.read(&p.remote, &descs, vec![0; len]);
    let d = |region, offset, len| Descriptor {
        region,
        offset,
        len,
    };
    assert!(matches!(
        read(vec![], 0),
        Err(TransferError::BadDescriptor(_))
    ));
    assert!(matches!(
        read(vec![d(999, 0, 1)], 1),
        Err(TransferError::BadDescriptor(_))
    ));
    assert!(matches!(
        read(vec![d(p.host_id, (1 << 20) - 1, 2)], 2),
        Err(TransferError::BadDescriptor(_))
    ));
    assert!(matches!(
        read(vec![d(p.host_id, u64::MAX, 2)], 2),
        Err(TransferError::BadDescriptor(_))
    ));
    assert!(matches!(
        read(vec![d(p.host_id, 0, 0)], 0),
        Err(TransferError::BadDescriptor(_))
    ));
    assert!(matches!(
        read(vec![d(p.host_id, 0, 10)], 11),
        Err(TransferError::DestinationSize { .. })
    ));
    assert!(matches!(
        p.initiator
            .read("nobody", &[d(p.host_id, 0, 1)], vec![0; 1]),
        Err(TransferError::UnknownRemote(_))
    ));
    // Stale metadata that claims more than the target has: the target refuses.
    let mut md = p.target.metadata();
    md.name = "stale".into();
    for r in &mut md.regions {
        r.len *= 4;
    }
    p.initiator.load_remote(md).unwrap();
    let err = p
        .initiator
        .read("stale", &[d(p.host_id, 2 << 20, 4)], vec![0; 4])
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TransferError::Remote(m) if m.contains("outside")),
        "{err}"
    );
    // Metadata without an address cannot be loaded.
    assert!(p
        .initiator
        .load_remote(AgentMetadata {
            name: "x".into(),
            address: String::new(),
            backend: "tcp".into(),
            regions: vec![RegionInfo {
                id: 1,
                len: 1,
                page_len: 0,
                device: false
            }],
        })
        .is_err());
}

#[tokio::test]
async fn malformed_frames_get_an_error_and_the_agent_keeps_serving() {
    let p = pair().await;
    let addr = p.target.metadata().address;
    // Oversized length prefix.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 2, 3])
        .await
        .unwrap();
    match read_frame(&mut s, MAX_FRAME_LEN).await.unwrap() {
        Some(Frame::Error { message, .. }) => assert!(message.contains("exceeds"), "{message}"),
        other => panic!("expected an Error frame, got {other:?}"),
    }
    assert_eq!(
        read_frame(&mut s, MAX_FRAME_LEN).await.unwrap(),
        None,
        "closed"
    );
    // Unknown kind.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&[1, 0, 0, 0, 200]).await.unwrap();
    assert!(matches!(
        read_frame(&mut s, MAX_FRAME_LEN).await.unwrap(),
        Some(Frame::Error { .. })
    ));
    // A Read whose descriptor count lies about its payload.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&[13, 0, 0, 0, 3, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0])
        .await
        .unwrap();
    assert!(matches!(
        read_frame(&mut s, MAX_FRAME_LEN).await.unwrap(),
        Some(Frame::Error { .. })
    ));
    // A response frame sent as a request.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&Frame::NotifyAck.to_bytes()).await.unwrap();
    assert!(matches!(
        read_frame(&mut s, MAX_FRAME_LEN).await.unwrap(),
        Some(Frame::Error { .. })
    ));
    // Random garbage, then the agent still serves a well-formed read.
    for seed in 0..20u8 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let junk: Vec<u8> = (0..64)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
            .collect();
        let _ = s.write_all(&junk).await;
        drop(s);
    }
    let out = p
        .initiator
        .read(
            &p.remote,
            &[Descriptor {
                region: p.host_id,
                offset: 0,
                len: 32,
            }],
            vec![0; 32],
        )
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(out.data, p.host[..32]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers() {
    let p = pair().await;
    let mut xfers = Vec::new();
    for i in 0..32u64 {
        let off = i * 30_000;
        let len = 1000 + i * 500;
        let t = p
            .initiator
            .read(
                &p.remote,
                &[Descriptor {
                    region: p.host_id,
                    offset: off,
                    len,
                }],
                vec![0; len as usize],
            )
            .unwrap();
        xfers.push((t, off as usize, len as usize));
    }
    for (t, off, len) in xfers {
        let out = t.wait().await.unwrap();
        assert_eq!(out.data, p.host[off..off + len]);
    }
    assert_eq!(p.target.stats().reads_served, 32);
}

#[tokio::test]
async fn unreachable_agent_is_a_connect_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let a = Agent::new("a", Backend::Tcp).unwrap();
    let err = a.fetch_metadata(&addr).await.unwrap_err();
    assert!(matches!(err, TransferError::Connect { .. }), "{err}");
}

/// Runs the CUDA path where a driver and a device exist; elsewhere checks that detection says
/// so without panicking and that the CUDA backend refuses cleanly.
#[tokio::test]
async fn cuda_backend_or_loud_skip() {
    match cuda::detect() {
        CudaStatus::Unavailable { reason } => {
            println!("SKIPPED: no CUDA driver ({reason}); checked that detection and the backend fail cleanly");
            let err = Agent::new("gpu", Backend::Cuda).unwrap_err();
            assert!(matches!(err, TransferError::BackendUnavailable(_)), "{err}");
            assert!(cuda::CudaDevice::open(0).is_err());
        }
        CudaStatus::Available { devices } => {
            println!("CUDA: {devices} device(s); running the device-memory transfer");
            let target = Agent::new("gpu-target", Backend::Cuda).unwrap();
            let dev = target.cuda().unwrap().clone();
            let data = pattern(3 << 20, 3);
            let region = Arc::new(dev.upload(&data).unwrap());
            let h = target.register_memory(Memory::Device(region));
            let addr = target
                .listen("127.0.0.1:0".parse().unwrap(), None)
                .await
                .unwrap();
            let init = Agent::new("gpu-init", Backend::Cuda).unwrap();
            let md = init.fetch_metadata(&addr.to_string()).await.unwrap();
            assert!(md.region(h.id).unwrap().device);
            let name = init.load_remote(md).unwrap();
            let dst = init.cuda().unwrap().alloc(1 << 20).unwrap();
            init.read_into_device(
                &name,
                &[Descriptor {
                    region: h.id,
                    offset: 1 << 20,
                    len: 1 << 20,
                }],
                &dst,
                0,
            )
            .await
            .unwrap();
            assert_eq!(dst.to_host().unwrap(), data[1 << 20..2 << 20]);
        }
    }
}
