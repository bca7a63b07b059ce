# Independent test vectors for proto/src/{hashing,worker_id}.rs (pip install xxhash; python3 gen_vectors.py).
# SipHash-1-3 is written out here from the paper so that it shares no code with Rust std.
def rotl(x,b): return ((x<<b)|(x>>(64-b))) & 0xFFFFFFFFFFFFFFFF
M=0xFFFFFFFFFFFFFFFF
def siphash13(data, k0=0, k1=0):
    v0=k0^0x736f6d6570736575; v1=k1^0x646f72616e646f6d; v2=k0^0x6c7967656e657261; v3=k1^0x7465646279746573
    def rnd():
        nonlocal v0,v1,v2,v3
        v0=(v0+v1)&M; v1=rotl(v1,13); v1^=v0; v0=rotl(v0,32)
        v2=(v2+v3)&M; v3=rotl(v3,16); v3^=v2
        v0=(v0+v3)&M; v3=rotl(v3,21); v3^=v0
        v2=(v2+v1)&M; v1=rotl(v1,17); v1^=v2; v2=rotl(v2,32)
    n=len(data); end=n-n%8
    for i in range(0,end,8):
        m=int.from_bytes(data[i:i+8],'little'); v3^=m; rnd(); v0^=m
    b=(n&0xff)<<56
    b|=int.from_bytes(data[end:],'little')
    v3^=b; rnd(); v0^=b
    v2^=0xff
    for _ in range(3): rnd()
    return (v0^v1^v2^v3)&M
for s in ["vllm-worker-0",""]:
    print(s, siphash13(s.encode()+b'\xff') & 0x001FFFFFFFFFFFFF)
import xxhash
print(hex(xxhash.xxh3_64_intdigest(b"hello")))
import struct
le=lambda ts: b''.join(struct.pack('<I',t) for t in ts)
a=xxhash.xxh3_64_intdigest(le([1,2,3,4]),1337); b=xxhash.xxh3_64_intdigest(le([5,6,7,8]),1337)
print(a,b, xxhash.xxh3_64_intdigest(struct.pack('<QQ',a,b),1337))
seed=(1337+xxhash.xxh3_64_intdigest(b"my-lora",0)+xxhash.xxh3_64_intdigest(b"tenant-a",1))%2**64
print(seed, xxhash.xxh3_64_intdigest(le([1,2,3,4]),seed))
