// Command app is the workload of the cluster tests:
//
//	app serve ADDR          answer every connection with where it arrived
//	app proxy sidecar ADDR... a stand-in sidecar (its arguments start as
//	                        Istio's proxy's do): answer with the original
//	                        destination (SO_ORIGINAL_DST) of each connection
//	app http ADDR           answer HTTP requests with 200 and print each
//	                        one's method, path and peer (a probe's source)
//	app dial-loop ADDR      connect twice a second and print the answer
//	app spin N              keep N threads busy: a pod loading its node
package main

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/origdst"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: app serve ADDR | app proxy ADDR... | app http ADDR | app dial-loop ADDR | app spin N")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		listen(os.Args[2], func(c net.Conn) string {
			return fmt.Sprintf("served by %s for %s", c.LocalAddr(), c.RemoteAddr())
		})
		select {}
	case "proxy":
		addrs := os.Args[2:]
		if len(addrs) > 0 && addrs[0] == "sidecar" {
			addrs = addrs[1:]
		}
		for _, a := range addrs {
			listen(a, func(c net.Conn) string {
				orig, err := origdst.Get(c)
				if err != nil {
					return fmt.Sprintf("proxy on %s: no original destination: %v", c.LocalAddr(), err)
				}
				line := fmt.Sprintf("proxy on %s: original destination %s from %s", c.LocalAddr(), orig, c.RemoteAddr())
				fmt.Println(line)
				return line
			})
		}
		select {}
	case "http":
		srv := &http.Server{Addr: os.Args[2], ReadHeaderTimeout: 5 * time.Second,
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Printf("http %s %s from %s\n", r.Method, r.URL.Path, r.RemoteAddr)
				fmt.Fprintln(w, "ok")
			})}
		fmt.Fprintln(os.Stderr, srv.ListenAndServe())
		os.Exit(1)
	case "spin":
		n, err := strconv.Atoi(os.Args[2])
		if err != nil || n < 1 {
			fmt.Fprintln(os.Stderr, "spin: want a thread count, got", os.Args[2])
			os.Exit(2)
		}
		for i := 0; i < n; i++ {
			go spin()
		}
		select {}
	case "dial-loop":
		for {
			c, err := net.DialTimeout("tcp", os.Args[2], 2*time.Second)
			if err != nil {
				fmt.Println("dial", os.Args[2], "failed:", err)
			} else {
				_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
				line, _ := bufio.NewReader(c).ReadString('\n')
				fmt.Print("dial ", os.Args[2], ": ", line)
				_ = c.Close()
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
}

func listen(addr string, answer func(net.Conn) string) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				continue
			}
			go func(c net.Conn) {
				defer c.Close()
				fmt.Fprintln(c, answer(c))
			}(c)
		}
	}()
}

// spin burns CPU until the process is killed; the counter keeps the
// compiler from removing the loop.
func spin() {
	var x uint64
	for {
		x = x*6364136223846793005 + 1442695040888963407
		if x == 0 {
			fmt.Println(x)
		}
	}
}
