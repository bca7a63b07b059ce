//! The GAIE / ext_proc message sequences, driven message by message against a real `kvroute-epp`
//! process (this test plays Envoy): FULL_DUPLEX_STREAMED with chunking and trailers, BUFFERED,
//! body-less requests, immediate responses, subset hints in list form, and the response path
//! (verbatim echo, booking release).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, CommonResponse, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvroute_tests::harness::extproc::{self, Stream, BUFFERED, FULL_DUPLEX_STREAMED};
use kvroute_tests::harness::stack::{start_worker, EppProcess, StackOptions};

const CHAT: &str = "/v1/chat/completions";
const DEST: &str = "x-gateway-destination-endpoint";

fn chat_body(seed: u64, words: usize) -> Vec<u8> {
    let text = kvroute_tests::harness::conversation::text(seed, words);
    serde_json::to_vec(&serde_json::json!({
        "model": "Qwen/Qwen3-0.6B",
        "messages": [{"role": "user", "content": text}]
    }))
    .expect("json")
}

fn common(resp: &ProcessingResponse) -> Option<&CommonResponse> {
    match resp.response.as_ref()? {
        processing_response::Response::RequestHeaders(h) => h.response.as_ref(),
        processing_response::Response::RequestBody(b) => b.response.as_ref(),
        _ => None,
    }
}

fn set_headers(c: &CommonResponse) -> HashMap<String, String> {
    c.header_mutation
        .iter()
        .flat_map(|m| m.set_headers.iter())
        .filter_map(|o| o.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8_lossy(&h.raw_value).into_owned(),
            )
        })
        .collect()
}

fn lb_destination(resp: &ProcessingResponse) -> Option<String> {
    let ns = resp.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = ns.kind.as_ref() else {
        return None;
    };
    match s.fields.get(DEST)?.kind.as_ref()? {
        Kind::StringValue(v) => Some(v.clone()),
        _ => None,
    }
}

/// The bytes and end-of-stream flag of a streamed body reply (request or response side).
fn streamed(resp: &ProcessingResponse) -> Option<(Vec<u8>, bool)> {
    let br = match resp.response.as_ref()? {
        processing_response::Response::RequestBody(b)
        | processing_response::Response::ResponseBody(b) => b,
        _ => return None,
    };
    match br
        .response
        .as_ref()?
        .body_mutation
        .as_ref()?
        .mutation
        .as_ref()?
    {
        body_mutation::Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
        _ => None,
    }
}

fn subset(values: Vec<&str>) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: values
                .into_iter()
                .map(|v| Value {
                    kind: Some(Kind::StringValue(v.into())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    list,
                )]),
            },
        )]),
        ..Default::default()
    }
}

async fn next(stream: &mut Stream) -> ProcessingResponse {
    tokio::time::timeout(Duration::from_secs(10), stream.recv())
        .await
        .expect("EPP answered in time")
        .expect("stream ok")
        .expect("a reply")
}

/// Reads streamed body replies until end of stream (or `count` replies), returning the bytes.
async fn body_replies(
    stream: &mut Stream,
    until_eos: bool,
    count: usize,
) -> (Vec<u8>, Vec<usize>, bool) {
    let (mut all, mut sizes, mut eos) = (Vec::new(), Vec::new(), false);
    while if until_eos { !eos } else { sizes.len() < count } {
        let r = next(stream).await;
        let (b, e) = streamed(&r).expect("a streamed body reply");
        sizes.push(b.len());
        all.extend_from_slice(&b);
        eos = e;
    }
    (all, sizes, eos)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_message_sequences() -> anyhow::Result<()> {
    let opts = StackOptions::default();
    let w0 = start_worker("proto-worker-0", &opts, &[]).await?;
    let w1 = start_worker("proto-worker-1", &opts, &[]).await?;
    let epp = EppProcess::for_workers(&[&w0, &w1], &[], &opts.log_dir).await?;
    let mut client = extproc::connect(epp.grpc_port).await?;
    let endpoints = [w0.http.clone(), w1.http.clone()];

    // 1. FULL_DUPLEX_STREAMED, a 200 KB body in two chunks ending with trailers: headers reply
    //    held until the body ends, then chunks of at most 62,000 bytes (no eos: trailers follow),
    //    then the trailers reply. A client-sent hint header is removed.
    let body = chat_body(1, 30_000);
    assert!(body.len() > 150_000);
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", CHAT),
            ("x-request-id", "fds-1"),
            ("x-dynamo-prefill-instance-id", "666"),
        ],
        false,
        FULL_DUPLEX_STREAMED,
        None,
    )
    .await?;
    let (a, b) = body.split_at(body.len() / 2);
    s.request_body(a, false).await?;
    s.request_body(b, false).await?;
    s.request_trailers().await?;
    let h = next(&mut s).await;
    let c = common(&h).expect("a request headers reply");
    assert!(matches!(
        h.response,
        Some(processing_response::Response::RequestHeaders(_))
    ));
    assert!(c.clear_route_cache);
    let set = set_headers(c);
    let dest = set.get(DEST).expect("destination header").clone();
    assert!(endpoints.contains(&dest), "{dest}");
    assert_eq!(set.get("content-length"), Some(&body.len().to_string()));
    assert_eq!(
        set.get("x-dynamo-routing-mode").map(String::as_str),
        Some("aggregated")
    );
    let id = set
        .get("x-dynamo-worker-instance-id")
        .expect("worker id header");
    assert!(id == &w0.instance_id.to_string() || id == &w1.instance_id.to_string());
    let removed = &c.header_mutation.as_ref().expect("mutation").remove_headers;
    assert!(
        removed.contains(&"x-dynamo-prefill-instance-id".to_string()),
        "{removed:?}"
    );
    let list = lb_destination(&h).expect("envoy.lb metadata");
    assert!(
        list.starts_with(&dest) && list.contains(','),
        "fallback list {list}"
    );
    let (echo, sizes, _) = body_replies(&mut s, false, body.len().div_ceil(62_000)).await;
    assert!(sizes.iter().all(|&n| n <= 62_000), "{sizes:?}");
    assert_eq!(echo, body, "body echoed unchanged");
    let t = next(&mut s).await;
    assert!(matches!(
        t.response,
        Some(processing_response::Response::RequestTrailers(_))
    ));

    // ...and the response path: chunks echoed verbatim, the booking released at end of stream.
    assert_eq!(
        epp.metric("inference_objective_running_requests").await?,
        Some(1.0)
    );
    s.response_headers(None, false).await?;
    assert!(matches!(
        next(&mut s).await.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    for (chunk, eos) in [
        (&b"data: {\"x\":1}\n\n"[..], false),
        (&b"data: [DONE]\n\n"[..], true),
    ] {
        s.response_body(chunk, eos).await?;
        let r = next(&mut s).await;
        assert!(matches!(
            r.response,
            Some(processing_response::Response::ResponseBody(_))
        ));
        assert_eq!(streamed(&r), Some((chunk.to_vec(), eos)));
    }
    assert_eq!(
        epp.metric("inference_objective_running_requests").await?,
        Some(0.0)
    );
    drop(s);

    // 2. FULL_DUPLEX_STREAMED ending with an empty end-of-stream chunk: eos on the last reply.
    let body = chat_body(2, 200);
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "POST"), (":path", CHAT)],
        false,
        FULL_DUPLEX_STREAMED,
        None,
    )
    .await?;
    s.request_body(&body, false).await?;
    s.request_body(&[], true).await?;
    let h = next(&mut s).await;
    let set = set_headers(common(&h).expect("headers reply"));
    assert!(
        set.contains_key("x-request-id"),
        "a generated request id is set: {set:?}"
    );
    let (echo, _, eos) = body_replies(&mut s, true, 0).await;
    assert!(eos);
    assert_eq!(echo, body);
    drop(s);
    // The stream ending without a response path also releases the booking.
    let deadline = Instant::now() + Duration::from_secs(3);
    while epp.metric("inference_objective_running_requests").await? != Some(0.0) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "booking not released when the stream ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 3. BUFFERED: an empty headers reply first, the routing mutation on the body reply.
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "POST"), (":path", CHAT)],
        false,
        BUFFERED,
        None,
    )
    .await?;
    let h = next(&mut s).await;
    assert!(matches!(
        h.response,
        Some(processing_response::Response::RequestHeaders(_))
    ));
    assert!(
        common(&h).is_none_or(|c| c.header_mutation.is_none()),
        "BUFFERED headers reply carries no mutation"
    );
    s.request_body(&chat_body(3, 100), true).await?;
    let b = next(&mut s).await;
    assert!(matches!(
        b.response,
        Some(processing_response::Response::RequestBody(_))
    ));
    let set = set_headers(common(&b).expect("body reply"));
    assert!(endpoints.contains(set.get(DEST).expect("destination on the body reply")));
    assert!(lb_destination(&b).is_some());
    assert!(
        !set.contains_key("content-length"),
        "BUFFERED keeps the original content-length"
    );
    drop(s);

    // 3b. BUFFERED with trailers (HTTP/2 clients): the body reply carries the mutation, then
    //     the trailers reply; never a second headers reply.
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "POST"), (":path", CHAT)],
        false,
        BUFFERED,
        None,
    )
    .await?;
    assert!(matches!(
        next(&mut s).await.response,
        Some(processing_response::Response::RequestHeaders(_))
    ));
    s.request_body(&chat_body(3, 100), false).await?;
    s.request_trailers().await?;
    let b = next(&mut s).await;
    assert!(
        matches!(
            b.response,
            Some(processing_response::Response::RequestBody(_))
        ),
        "{b:?}"
    );
    assert!(set_headers(common(&b).expect("body reply")).contains_key(DEST));
    let t = next(&mut s).await;
    assert!(matches!(
        t.response,
        Some(processing_response::Response::RequestTrailers(_))
    ));
    drop(s);

    // 4. Body-less request: answered at once.
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
        FULL_DUPLEX_STREAMED,
        None,
    )
    .await?;
    let h = next(&mut s).await;
    assert!(endpoints.contains(
        set_headers(common(&h).expect("headers reply"))
            .get(DEST)
            .expect("destination")
    ));
    drop(s);

    // 5. Subset hint as a list: only that endpoint; an empty list: 503.
    for _ in 0..5 {
        let mut s = Stream::open(&mut client).await?;
        s.request_headers(
            &[(":method", "POST"), (":path", CHAT)],
            false,
            FULL_DUPLEX_STREAMED,
            Some(subset(vec![&w1.http])),
        )
        .await?;
        s.request_body(&chat_body(4, 50), true).await?;
        let h = next(&mut s).await;
        assert_eq!(
            set_headers(common(&h).expect("headers reply")).get(DEST),
            Some(&w1.http)
        );
    }
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "POST"), (":path", CHAT)],
        false,
        FULL_DUPLEX_STREAMED,
        Some(subset(vec![])),
    )
    .await?;
    s.request_body(&chat_body(4, 50), true).await?;
    let r = next(&mut s).await;
    let Some(processing_response::Response::ImmediateResponse(ir)) = r.response else {
        panic!("immediate 503")
    };
    assert_eq!(ir.status.map(|s| s.code), Some(503));

    // 6. Immediate 400 with an OpenAI JSON body and content type; the EPP then ends the stream.
    let mut s = Stream::open(&mut client).await?;
    s.request_headers(
        &[(":method", "POST"), (":path", CHAT)],
        false,
        FULL_DUPLEX_STREAMED,
        None,
    )
    .await?;
    s.request_body(b"{\"model\": [", true).await?;
    let r = next(&mut s).await;
    let Some(processing_response::Response::ImmediateResponse(ir)) = r.response else {
        panic!("immediate 400")
    };
    assert_eq!(ir.status.map(|s| s.code), Some(400));
    let err: serde_json::Value = serde_json::from_slice(&ir.body)?;
    assert_eq!(err["error"]["type"], "invalid_request_error");
    let ct = ir
        .headers
        .iter()
        .flat_map(|m| m.set_headers.iter())
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "content-type");
    assert_eq!(
        ct.map(|h| h.raw_value.as_slice()),
        Some(&b"application/json"[..])
    );
    assert!(
        s.recv().await?.is_none(),
        "stream ends after an immediate response"
    );
    Ok(())
}
