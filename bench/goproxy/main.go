// The Go row of bench/compare.py (issue 24): the minimum of a Go gateway.
// It checks the client key, swaps in the upstream credential and proxies
// with net/http + httputil.ReverseProxy (keep-alive to the upstream,
// FlushInterval -1 so SSE events pass at once). Standard library only.
//
//	go build -o goproxy main.go
//	GOMAXPROCS=1 ./goproxy LISTEN_ADDR UPSTREAM_URL CLIENT_KEY UPSTREAM_KEY
package main

import (
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
)

func main() {
	target, err := url.Parse(os.Args[2])
	if err != nil {
		panic(err)
	}
	want, upstream := "Bearer "+os.Args[3], "Bearer "+os.Args[4]
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.FlushInterval = -1
	proxy.Transport = &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024}
	handler := func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != want {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			w.Write([]byte(`{"error":{"message":"invalid key","type":"invalid_request_error","code":"invalid_api_key"}}`))
			return
		}
		r.Header.Set("Authorization", upstream)
		proxy.ServeHTTP(w, r)
	}
	panic(http.ListenAndServe(os.Args[1], http.HandlerFunc(handler)))
}
