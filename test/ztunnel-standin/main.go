// Command ztunnel-standin runs the stand-in ztunnel (internal/ztunnelsim)
// as a process of its own, as ztunnel runs on a node: it connects to the
// agent's ZDS socket, binds ztunnel's listeners in every pod it is handed
// and connects again whenever the connection ends, until SIGTERM or
// SIGINT.
//
//	ztunnel-standin --socket /var/run/ztunnel/ztunnel.sock [--state FILE] [--v]
//
// It logs to stderr. With --state it keeps FILE holding what it has seen
// (ztunnelsim.State as JSON, replaced whole on every change), for a test
// in another process to read.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"reflect"
	"syscall"

	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

func main() {
	socket := flag.String("socket", "/var/run/ztunnel/ztunnel.sock", "the agent's ZDS socket (ztunnel's INPOD_UDS)")
	stateFile := flag.String("state", "", "keep this file holding the stand-in's state as JSON")
	verbose := flag.Bool("v", false, "log at debug level (connection attempts)")
	flag.Parse()

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	sim, err := ztunnelsim.Start(ztunnelsim.Config{Path: *socket, Listeners: true, Reconnect: true, Log: log})
	if err != nil {
		log.Error("starting", "error", err.Error())
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log.Info("stand-in ztunnel started", "socket", *socket)

	last := ztunnelsim.State{Workloads: map[string]ztunnelsim.Workload{}}
	for {
		st, err := sim.Wait(ctx, func(s ztunnelsim.State) bool { return !reflect.DeepEqual(s, last) })
		if err != nil {
			break // signalled
		}
		report(log, last, st)
		if *stateFile != "" {
			if err := writeState(*stateFile, st); err != nil {
				log.Error("writing the state file", "error", err.Error())
			}
		}
		last = st
	}
	sim.Close()
	if *stateFile != "" {
		_ = writeState(*stateFile, sim.State())
	}
	log.Info("stand-in ztunnel stopped")
}

// report logs what changed: the connection, and each new request.
func report(log *slog.Logger, was, now ztunnelsim.State) {
	if was.Connected != now.Connected || was.Conns != now.Conns {
		log.Info("connection", "connected", now.Connected, "conns", now.Conns)
	}
	for _, ev := range now.Events[min(len(was.Events), len(now.Events)):] {
		attrs := []any{"conn", ev.Conn, "seq", ev.Seq, "kind", ev.Req.Kind.String(), "uid", ev.Req.UID, "fds", ev.FDs}
		if ev.Req.Info != nil {
			attrs = append(attrs, "pod", ev.Req.Info.Namespace+"/"+ev.Req.Info.Name)
		}
		if ev.Inode != 0 {
			attrs = append(attrs, "inode", ev.Inode)
		}
		if ev.NoOp {
			attrs = append(attrs, "noop", true)
		}
		if ev.Nack != "" {
			attrs = append(attrs, "nack", ev.Nack)
		}
		if ev.ProtocolError != "" {
			attrs = append(attrs, "protocolError", ev.ProtocolError)
		}
		log.Info("request", attrs...)
	}
	if len(was.Workloads) != len(now.Workloads) {
		log.Info("workloads", "count", len(now.Workloads))
	}
	if now.Stopped && !was.Stopped {
		log.Error("stopped on a protocol error", "errors", fmt.Sprint(now.ProtocolErrors))
	}
}

// writeState replaces path whole, so a reader never sees half of it.
func writeState(path string, st ztunnelsim.State) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".state-*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		_ = os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}
