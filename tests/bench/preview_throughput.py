#!/usr/bin/env python3
# Requests per second through the preview proxy of a running `berth dev` stack (from deploy/up):
# a busybox httpd in a fresh runc sandbox, N keep-alive connections, preview-token auth.
# Usage: tests/bench/preview_throughput.py [connections]   (reads .berth/api-key, .berth/stack.env)
import json, os, sys, threading, time, urllib.request, http.client
key=open(os.environ.get("BERTH_STATE_DIR", ".berth") + "/api-key").read().strip()
env=dict(l.strip().split("=",1) for l in open(os.environ.get("BERTH_STATE_DIR", ".berth") + "/stack.env") if "=" in l)
api=env.get("BERTH_API", "http://127.0.0.1:8080")
proxy=env["BERTH_PROXY"].replace("http://",""); domain=env["BERTH_PREVIEW_DOMAIN"]
def call(method, path, body=None):
    req=urllib.request.Request(api+path, method=method, data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization":"Bearer "+key,"content-type":"application/json"})
    with urllib.request.urlopen(req) as r: return json.load(r)
sb=call("POST","/v1/sandboxes?wait=running&timeout=120s",{"template":"base","vcpus":1,"memory_mib":128,"metadata":{"berth-bench":"tput"}})
sid=sb["id"]
call("POST",f"/v1/sandboxes/{sid}/exec",{"cmd":["sh","-c","mkdir -p /www && echo hello > /www/index.html && (httpd -p 8000 -h /www &)"]})
tok=call("POST",f"/v1/sandboxes/{sid}/ports/8000/token",{})["token"]
host=f"8000-{sid}.{domain}"
phost,pport=proxy.split(":")
N_THREADS=int(sys.argv[1]) if len(sys.argv)>1 else 16; PER=125
ok=[0]*N_THREADS; bad={}
def worker(i):
    c=http.client.HTTPConnection(phost,int(pport),timeout=30)
    for _ in range(PER):
        try:
            c.request("GET","/",headers={"Host":host,"X-Berth-Preview-Token":tok})
            r=c.getresponse(); r.read()
            if r.status==200: ok[i]+=1
            else: bad[r.status]=bad.get(r.status,0)+1
        except Exception as e:
            bad[type(e).__name__]=bad.get(type(e).__name__,0)+1
            c=http.client.HTTPConnection(phost,int(pport),timeout=30)
time.sleep(1)
t=time.time(); ts=[threading.Thread(target=worker,args=(i,)) for i in range(N_THREADS)]
[x.start() for x in ts]; [x.join() for x in ts]; el=time.time()-t
print(f"token auth, keep-alive, {N_THREADS} connections: {sum(ok)} of {N_THREADS*PER} answered 200 in {el:.2f} s: {sum(ok)/el:.0f} requests/s; other: {bad}")
urllib.request.urlopen(urllib.request.Request(api+f"/v1/sandboxes/{sid}",method="DELETE",headers={"Authorization":"Bearer "+key})).read()
