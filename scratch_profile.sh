set -u
out=$OUT/prof; mkdir -p $out
RTC_AGENT_WORKER_TRACE=$out/trace python3 -m rtc_agent.cli serve --model synthetic:30b-a3b --port 8080 --ice-host-address 127.0.0.1 --max-answer-s 8 > $out/serve.log 2>&1 &
server=$!
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz')" 2>/dev/null; do sleep 1; done
pid=$(python3 -c "import json, urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:8080/readyz'))['engine_pid'])")
lt() { timeout 100 python3 -m rtc_agent.cli loadtest http://127.0.0.1:8080 --wav .whl/thanks.wav --retry-s 60 --ice-host-address 127.0.0.1 --json --callers 24 > $out/$1.json 2> $out/$1.err; python3 -c "import json,sys; o=json.load(open(sys.argv[1]))['overall']; print(sys.argv[1], o['server_ttfp_ms'], o['engine_ttfp_ms'])" $out/$1.json; }
lt warm
/tmp/site/bin/py-spy record -p $pid -r 250 -d 40 --threads --idle --native --nonblocking -f raw -o $out/engine.raw > $out/pyspy.log 2>&1 &
spy=$!
sleep 2; lt burst1; lt burst2
wait $spy; tail -3 $out/pyspy.log
kill -INT $server; wait $server
cd $OUT && tar -czf prof.tar.gz prof && rm -r prof
