// Command app is the test workload of the cluster tests: it serves TCP
// (answering with what it saw) or dials once and reports the answer.
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: app serve ADDR | app dial ADDR")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		l, err := net.Listen("tcp", os.Args[2])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		for {
			c, err := l.Accept()
			if err != nil {
				continue
			}
			go func(c net.Conn) {
				defer c.Close()
				fmt.Fprintf(c, "served by %s for %s\n", c.LocalAddr(), c.RemoteAddr())
			}(c)
		}
	case "dial":
		c, err := net.DialTimeout("tcp", os.Args[2], 5*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		line, _ := bufio.NewReader(c).ReadString('\n')
		fmt.Print(line)
	}
}
