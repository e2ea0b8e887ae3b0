package sockserve

import (
	"context"
	"io"
	stdlog "log"
	"net"
	"net/http"
	"strconv"
	"time"
)

// ServeHTTP serves hs on l until ctx ends, then closes it (and with it l).
// The returned channel is closed once the server has stopped, so a caller
// can wait for it before cleaning up what the handlers use.
func ServeHTTP(ctx context.Context, l net.Listener, hs *http.Server) <-chan struct{} {
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = hs.Serve(l)
	}()
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-ctx.Done():
			_ = hs.Close()
		case <-served:
			// Serve gave up on its own (the listener failed): nothing to close.
		}
		<-served
	}()
	return done
}

// ServeTCP serves h on port (all addresses) until ctx ends; see ServeHTTP.
func ServeTCP(ctx context.Context, port int, h http.Handler) (<-chan struct{}, error) {
	return ServeTCPOn(ctx, net.Listen, port, h)
}

// ServeTCPOn is ServeTCP with the listen function given, so tests can bind
// the loopback's port 0 instead of a fixed one.
func ServeTCPOn(ctx context.Context, listen func(network, addr string) (net.Listener, error), port int, h http.Handler) (<-chan struct{}, error) {
	l, err := listen("tcp", net.JoinHostPort("", strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 2 * time.Minute}
	return ServeHTTP(ctx, l, hs), nil
}

// ServeSocket serves h on srv until ctx ends, with timeouts that a silent
// or slow client cannot stretch; stopping removes the socket's path and
// closes every connection. See ServeHTTP for the channel.
func ServeSocket(ctx context.Context, srv *Server, h http.Handler) <-chan struct{} {
	hs := &http.Server{Handler: h,
		ReadHeaderTimeout: srv.limits.ReadTimeout, ReadTimeout: srv.limits.ReadTimeout,
		WriteTimeout: 10 * time.Second, IdleTimeout: srv.limits.ReadTimeout, MaxHeaderBytes: 16 << 10,
		// What a bad client makes net/http say is of no use in the logs.
		ErrorLog: stdlog.New(io.Discard, "", 0),
		ConnState: func(c net.Conn, st http.ConnState) {
			if sc, ok := c.(*Conn); ok {
				sc.SetBusy(st == http.StateActive)
			}
		}}
	return ServeHTTP(ctx, srv, hs)
}
