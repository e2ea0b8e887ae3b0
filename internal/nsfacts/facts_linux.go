package nsfacts

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
)

// Facts are what preparing a pod's rules needs to know of its namespace:
// its addresses (which decide the IPv6 rules), and what of ours or of
// another writer is there already.
type Facts struct {
	// Addrs are the namespace's addresses in the kernel's order (all
	// IPv4 first), as PodAddrs lists them.
	Addrs []netip.Addr
	// TProxyRule: a policy rule sends marked packets to the TPROXY
	// table, in either family.
	TProxyRule bool
	// Tables are the namespace's nf_tables tables; NoNFTables says the
	// kernel has no nf_tables at all.
	Tables     []Table
	NoNFTables bool
	// LegacyTables: iptables-legacy has tables there, IPv4 or IPv6.
	LegacyTables bool
	// ForeignUserNS: the namespace belongs to a user namespace other
	// than this process's (a pod with hostUsers: false).
	ForeignUserNS bool
	// IPSets: the namespace holds ipsets, or whether it does could not
	// be read (the kernel numbers sets in order of creation, and prepared
	// iptables rules name them by number).
	IPSets bool
}

// Table is an nf_tables table: its family (NFPROTO_*) and name.
type Table struct {
	Family uint8
	Name   string
}

// ReadFactsIn reads the facts of the network namespace at netnsPath,
// from the calling goroutine's thread (nlsteps.InNetNS).
func ReadFactsIn(netnsPath string) (Facts, error) {
	return readFactsIn(netnsPath, ReadFacts)
}

// ReadFactsForIn is ReadFactsFor in the network namespace at netnsPath.
func ReadFactsForIn(netnsPath, kind string, ipsets bool) (Facts, error) {
	return readFactsIn(netnsPath, func() (Facts, error) { return ReadFactsFor(kind, ipsets) })
}

func readFactsIn(netnsPath string, read func() (Facts, error)) (Facts, error) {
	f, err := os.Open(netnsPath) //nolint:gosec // G304: the runtime's namespace path, entered only if it is one (setns refuses other files)
	if err != nil {
		return Facts{}, fmt.Errorf("opening the pod's network namespace: %w", err)
	}
	defer f.Close()
	var facts Facts
	err = nlsteps.InNetNS(f, func() error {
		var err error
		facts, err = read()
		return err
	})
	return facts, err
}

// ReadFacts reads the calling thread's namespace: two dumps on one
// routing socket, one on each of two netfilter sockets (nf_tables'
// tables, ipsets), two /proc files and one ioctl, each in a plain system
// call. The agent reads the namespace of every pod whose ADD it serves
// itself.
func ReadFacts() (Facts, error) {
	return readFacts(true, true)
}

// ReadFactsFor reads of the calling thread's namespace only what Unfit
// looks at for prepared requests of kind, making ipsets or not, and the
// addresses: the relay's check before it sends, on every pod's path. The
// facts it leaves unread are zero, so Unfit(kind, ipsets) answers as it
// would over ReadFacts. Native nftables rules care for neither iptables'
// tables nor ipsets nor the user namespace; iptables rules without sets,
// for no ipset. In a warm process (podnet's BenchmarkReadFacts) all the
// facts took 99-139 µs, nftables' 40-50 µs, iptables' without sets
// 73-78 µs: the ipset dump is the dearest part.
func ReadFactsFor(kind string, ipsets bool) (Facts, error) {
	if kind == KindNFTables {
		return readFacts(false, false)
	}
	return readFacts(true, ipsets)
}

// readFacts reads the addresses, the policy rules and the nf_tables
// tables, then with iptables what else keeps iptables' rules out, and
// with ipsets whether the namespace holds any.
func readFacts(iptables, ipsets bool) (Facts, error) {
	var f Facts
	if err := f.readRouting(); err != nil {
		return f, err
	}
	if err := f.readTables(); err != nil {
		return f, err
	}
	if ipsets {
		f.IPSets = holdsIPSets()
	}
	if !iptables {
		return f, nil
	}
	f.LegacyTables = procNotEmpty("/proc/thread-self/net/ip_tables_names") || procNotEmpty("/proc/thread-self/net/ip6_tables_names")
	var err error
	f.ForeignUserNS, err = foreignUserNS()
	return f, err
}

func (f *Facts) readRouting() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("opening a routing socket: %w", err)
	}
	defer unix.Close(fd)
	err = dump(fd, unix.RTM_GETADDR, 8, 1, func(body []byte) {
		// ifaddrmsg: family, prefix length, flags, scope, index; then
		// the attributes. The interface's own address is IFA_LOCAL where
		// there is one (IFA_ADDRESS is then a point-to-point peer), as
		// the netlink library PodAddrs uses reads it.
		if len(body) < 8 {
			return
		}
		attrs, _ := nlsteps.ParseAttrs(body[8:])
		var addr, local []byte
		for _, a := range attrs {
			switch a.Type {
			case unix.IFA_ADDRESS:
				addr = a.Data
			case unix.IFA_LOCAL:
				local = a.Data
			}
		}
		if local != nil {
			addr = local
		}
		if ip, ok := netip.AddrFromSlice(addr); ok {
			f.Addrs = append(f.Addrs, ip.Unmap())
		}
	})
	if err != nil {
		return fmt.Errorf("listing pod addresses: %w", err)
	}
	err = dump(fd, unix.RTM_GETRULE, 8, 2, func(body []byte) {
		// fib_rule_hdr: the table is its fifth byte, or FRA_TABLE.
		if len(body) < 12 {
			return
		}
		table := uint32(body[4])
		var mark uint32
		attrs, _ := nlsteps.ParseAttrs(body[12:])
		for _, a := range attrs {
			switch {
			case a.Type == unix.FRA_TABLE && len(a.Data) == 4:
				table = binary.NativeEndian.Uint32(a.Data)
			case a.Type == unix.FRA_FWMARK && len(a.Data) == 4:
				mark = binary.NativeEndian.Uint32(a.Data)
			}
		}
		if mark == TProxyMark && table == TProxyTable {
			f.TProxyRule = true
		}
	})
	if err != nil {
		return fmt.Errorf("listing policy rules: %w", err)
	}
	return nil
}

func (f *Facts) readTables() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if errors.Is(err, unix.EPROTONOSUPPORT) {
		f.NoNFTables = true
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening a netfilter socket: %w", err)
	}
	defer unix.Close(fd)
	err = dump(fd, unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_GETTABLE, nlsteps.NfGenLen, 3, func(body []byte) {
		if len(body) < nlsteps.NfGenLen {
			return
		}
		attrs, _ := nlsteps.ParseAttrs(body[nlsteps.NfGenLen:])
		for _, a := range attrs {
			if a.Type == unix.NFTA_TABLE_NAME {
				f.Tables = append(f.Tables, Table{Family: body[0], Name: strings.TrimRight(string(a.Data), "\x00")})
			}
		}
	})
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL) {
		// nfnetlink without its nf_tables subsystem.
		f.NoNFTables = true
		return nil
	}
	if err != nil {
		return fmt.Errorf("listing nftables tables: %w", err)
	}
	return nil
}

// procNotEmpty reports whether a /proc file has anything in it.
func procNotEmpty(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var b [64]byte
	n, err := unix.Read(fd, b[:])
	return err == nil && strings.TrimSpace(string(b[:n])) != ""
}

// foreignUserNS reports whether the calling thread's network namespace
// belongs to another user namespace than this process.
func foreignUserNS() (bool, error) {
	fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	owner, err := unix.IoctlRetInt(fd, unix.NS_GET_USERNS)
	if err != nil {
		// Kernels without the ioctl (before 4.9) have no pods in user
		// namespaces either.
		return false, nil
	}
	defer unix.Close(owner)
	var theirs, ours unix.Stat_t
	if err := unix.Fstat(owner, &theirs); err != nil {
		return false, err
	}
	if err := unix.Stat("/proc/self/ns/user", &ours); err != nil {
		return false, err
	}
	return theirs.Dev != ours.Dev || theirs.Ino != ours.Ino, nil
}

// holdsIPSets reports whether the calling thread's namespace holds an
// ipset, true when that cannot be read. Without the ip_set module no
// namespace holds one, and asking would make the kernel try to load it
// on every pod's path, so the module's presence is looked at first.
func holdsIPSets() bool {
	if _, err := os.Stat("/sys/module"); err == nil {
		if _, err := os.Stat("/sys/module/ip_set"); errors.Is(err, fs.ErrNotExist) {
			return false
		}
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return true
	}
	defer unix.Close(fd)
	found := false
	err = dumpBody(fd, unix.NFNL_SUBSYS_IPSET<<8|ipsetCmdList, IPSetNamesRequest(), 4, func([]byte) { found = true })
	return found || err != nil
}

// The kernel's ipset protocol numbers this file uses (linux/netfilter/
// ipset/ip_set.h).
const (
	ipsetCmdList      = 7
	ipsetAttrProtocol = 1
	ipsetAttrFlags    = 6
	ipsetProtocol     = 6
)

// ipsetFlagListSetname asks a list for the sets' names alone (the
// kernel's IPSET_FLAG_LIST_SETNAME).
const ipsetFlagListSetname = 1 << 1

// IPSetNamesRequest is the body of an ipset list request for the sets'
// names only: the protocol version and the names-only flag.
func IPSetNamesRequest() []byte {
	b := nlsteps.NfGen(unix.NFPROTO_IPV4, 0)
	b = nlsteps.Attr(b, ipsetAttrProtocol, []byte{ipsetProtocol})
	return nlsteps.Attr(b, ipsetAttrFlags, binary.BigEndian.AppendUint32(nil, ipsetFlagListSetname))
}

// dump sends a dump request (hdrLen zero bytes of family header: every
// family) and calls fn with the body of each answer.
func dump(fd int, typ uint16, hdrLen int, seq uint32, fn func(body []byte)) error {
	return dumpBody(fd, typ, make([]byte, hdrLen), seq, fn)
}

// dumpBody is dump with a request body of the caller's.
func dumpBody(fd int, typ uint16, body []byte, seq uint32, fn func(body []byte)) error {
	req := binary.NativeEndian.AppendUint32(nil, uint32(nlsteps.HeaderLen+len(body)))
	req = binary.NativeEndian.AppendUint16(req, typ)
	req = binary.NativeEndian.AppendUint16(req, unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	req = binary.NativeEndian.AppendUint32(req, seq)
	req = binary.NativeEndian.AppendUint32(req, 0)
	req = append(req, body...)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 32<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		msgs, err := nlsteps.ParseMessages(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Seq != seq {
				continue
			}
			switch m.Type {
			case unix.NLMSG_DONE:
				return nil
			case unix.NLMSG_ERROR:
				if len(m.Body) >= 4 {
					if errno := -int32(binary.NativeEndian.Uint32(m.Body)); errno != 0 {
						return unix.Errno(errno)
					}
				}
				return nil
			default:
				fn(m.Body)
			}
		}
	}
}

// Unfit says why a namespace with these facts cannot take prepared
// requests of the kind ("" when it can). ipsets says the requests make
// ipsets: the kernel numbers ipsets in order of creation and the rules
// name them by number, so only a namespace with none numbers them as
// the scratch one did.
func (f *Facts) Unfit(kind string, ipsets bool) string {
	if f.TProxyRule {
		return "the namespace has a TPROXY policy rule already"
	}
	if kind == KindNFTables {
		for _, t := range f.Tables {
			if t.Family == unix.NFPROTO_INET && strings.HasPrefix(t.Name, NFTablesPrefix) {
				return "the namespace has tables of ours already"
			}
		}
		return ""
	}
	switch {
	case f.ForeignUserNS:
		// Owner matches are only taken from a writer in the pod's own
		// user namespace, which only a process of its own can enter.
		return "the pod has a user namespace of its own"
	case f.LegacyTables:
		return "the namespace has legacy iptables tables"
	case f.NoNFTables:
		return "the kernel has no nf_tables"
	case ipsets && f.IPSets:
		return "the namespace holds ipsets"
	}
	for _, t := range f.Tables {
		if (t.Family == unix.NFPROTO_IPV4 || t.Family == unix.NFPROTO_IPV6) && iptablesTables[t.Name] {
			return "the namespace has iptables rules already"
		}
	}
	return ""
}

// Tables iptables can make in a family that our rules use: a namespace
// holding one of them is not fresh.
var iptablesTables = map[string]bool{"nat": true, "mangle": true, "raw": true}
