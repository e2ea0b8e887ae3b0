// Package nftables programs the sidecar rules through netlink into inet
// tables named as Istio's native nftables mode names them, in one atomic
// transaction per pod, with no firewall binary on the node.
package nftables

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// TablePrefix names our tables: istio-proxy-nat, -mangle, -raw.
const TablePrefix = nsfacts.NFTablesPrefix

// Rule is one nftables rule: its text (nft syntax, for goldens and logs)
// and its netlink expressions.
type Rule struct {
	Table, Chain string
	Text         string
	Exprs        []expr.Any
	// Origin is the list-valued setting the rule matches, if any.
	Origin string
}

// Chain is a chain of one of our tables; Base is set for hooked chains.
type Chain struct {
	Table, Name string
	Base        *BaseChain
}

// BaseChain says where a chain hooks in.
type BaseChain struct {
	Type     nftables.ChainType
	Hook     *nftables.ChainHook
	Priority *nftables.ChainPriority
	Spec     string
}

// Ruleset is everything one pod gets.
type Ruleset struct {
	Tables       []string
	Chains       []Chain
	Sets         []*Set
	Rules        []Rule
	TProxyRoutes bool
	IPv6         bool

	// prefix starts the names of the tables the ruleset owns in a
	// namespace; "" is the sidecar's TablePrefix.
	prefix string
}

// tablePrefix is what names the tables the ruleset replaces.
func (rs *Ruleset) tablePrefix() string {
	if rs == nil || rs.prefix == "" {
		return TablePrefix
	}
	return rs.prefix
}

// Set is a named set in one of our tables, holding the entries of a long
// list: what one rule looks up instead of a rule per entry.
type Set struct {
	Table, Name string
	// ID names the set within the transaction that creates it, so rules
	// of the same batch can refer to it.
	ID      uint32
	KeyType nftables.SetDatatype
	// Interval sets hold ranges. The others hold prefixes of one length
	// (Bits) as addresses, which rules look up masked, or ports paired
	// with a protocol (portKey), in a hash sized for them: the kernel
	// fills that several times faster than the tree an interval set is.
	Interval bool
	Bits     int
	Size     uint32
	Elements []nftables.SetElement
	// Origin is the annotation of the list; Listed how many entries it
	// gave.
	Origin string
	Listed int

	// Comment describes the set to people listing the ruleset.
	Comment string
	// KeepElements marks a set whose elements are not the ruleset's (the
	// node's probe set): they are neither compared nor replaced.
	KeepElements bool

	// The contents as written: the list's set, or interface names.
	list  *ruleset.IPSet
	names []string
	// protos are the protocols rules look a port set up with, in the
	// order of the rules: its elements pair each with every port.
	protos []byte
}

// TableName maps an iptables table to ours.
func TableName(table string) string { return TablePrefix + table }

// ChainName maps an iptables chain name to Istio's nft chain name.
func ChainName(chain string) string {
	return strings.ToLower(strings.ReplaceAll(chain, "_", "-"))
}

func baseChain(table, chain string) *BaseChain {
	switch table + "/" + chain {
	case "nat/PREROUTING":
		return &BaseChain{nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest, "type nat hook prerouting priority -100"}
	case "nat/OUTPUT":
		return &BaseChain{nftables.ChainTypeNAT, nftables.ChainHookOutput, nftables.ChainPriorityNATDest, "type nat hook output priority -100"}
	case "mangle/PREROUTING":
		return &BaseChain{nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityMangle, "type filter hook prerouting priority -150"}
	case "mangle/OUTPUT":
		// A route chain: a changed mark re-routes the packet, as iptables'
		// mangle OUTPUT does.
		return &BaseChain{nftables.ChainTypeRoute, nftables.ChainHookOutput, nftables.ChainPriorityMangle, "type route hook output priority -150"}
	case "raw/PREROUTING":
		return &BaseChain{nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityRaw, "type filter hook prerouting priority -300"}
	case "nat/POSTROUTING":
		return &BaseChain{nftables.ChainTypeNAT, nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource, "type nat hook postrouting priority 100"}
	case "raw/OUTPUT":
		return &BaseChain{nftables.ChainTypeFilter, nftables.ChainHookOutput, nftables.ChainPriorityRaw, "type filter hook output priority -300"}
	}
	return nil
}

// Build translates a plan. Every rule is qualified with its family, so a
// pod without IPv6 rules gets no IPv6 capture from the inet tables.
func Build(plan *ruleset.Plan) (*Ruleset, error) {
	rs := &Ruleset{TProxyRoutes: plan.TProxyRoutes, IPv6: plan.V6 != nil}
	seenTable := map[string]bool{}
	seenChain := map[string]bool{}
	for _, set := range plan.Sets() {
		final := set.Final()
		tables := make([]string, 0, len(final))
		for t := range final {
			tables = append(tables, t)
		}
		sort.Strings(tables)
		for _, table := range tables {
			if !seenTable[table] {
				seenTable[table] = true
				rs.Tables = append(rs.Tables, TableName(table))
			}
			chains := orderedChains(set, table, final[table])
			for _, chain := range chains {
				key := table + "/" + chain
				if !seenChain[key] {
					seenChain[key] = true
					var base *BaseChain
					if ruleset.IsBuiltin(chain) {
						base = baseChain(table, chain)
						if base == nil {
							return nil, fmt.Errorf("no nftables hook for %s/%s", table, chain)
						}
					}
					rs.Chains = append(rs.Chains, Chain{Table: TableName(table), Name: ChainName(chain), Base: base})
				}
				sets := func(name string) (*Set, error) { return rs.tableSet(TableName(table), name, set) }
				for _, item := range splitNetMatches(mergeInterfaceRuns(final[table][chain]), set) {
					args := item.Args
					if item.names != nil {
						s := rs.addSet(ifnameSet(TableName(table), item.Origin, item.names))
						args = slices.Clone(args)
						args[item.at] = setRef + s.Name
					}
					r, err := translate(set.Family, args, sets)
					if err != nil {
						return nil, fmt.Errorf("%s %s/%s %q: %w", set.Family, table, chain, strings.Join(args, " "), err)
					}
					r.Table, r.Chain, r.Origin = TableName(table), ChainName(chain), item.Origin
					rs.Rules = append(rs.Rules, r)
				}
			}
		}
	}
	return rs, nil
}

// orderedChains lists a table's chains in first-use order: base chains
// and Istio chains as the set declares them.
func orderedChains(set *ruleset.Set, table string, final map[string][]ruleset.Rule) []string {
	var out []string
	seen := map[string]bool{}
	for _, r := range set.Rules {
		if r.Table == table && !seen[r.Chain] {
			seen[r.Chain] = true
			out = append(out, r.Chain)
		}
	}
	rest := make([]string, 0)
	for c := range final {
		if !seen[c] {
			rest = append(rest, c)
		}
	}
	sort.Strings(rest)
	return append(out, rest...)
}

// Text renders the ruleset as nft input, for goldens and debugging.
func (rs *Ruleset) Text() string {
	var b strings.Builder
	for _, t := range rs.Tables {
		fmt.Fprintf(&b, "add table inet %s\n", t)
	}
	for _, c := range rs.Chains {
		if c.Base != nil {
			fmt.Fprintf(&b, "add chain inet %s %s { %s ; }\n", c.Table, c.Name, c.Base.Spec)
		} else {
			fmt.Fprintf(&b, "add chain inet %s %s\n", c.Table, c.Name)
		}
	}
	for _, st := range rs.Sets {
		flags := ""
		if st.Interval {
			flags = " flags interval ;"
		} else if st.Size > 0 {
			flags = fmt.Sprintf(" size %d ;", st.Size)
		}
		if st.Comment != "" {
			flags += fmt.Sprintf(" comment %q ;", st.Comment)
		}
		fmt.Fprintf(&b, "add set inet %s %s { type %s ;%s }\n", st.Table, st.Name, st.KeyType.Name, flags)
		if len(st.Elements) > 0 {
			fmt.Fprintf(&b, "add element inet %s %s { %s }\n", st.Table, st.Name, strings.Join(st.Entries(), ", "))
		}
	}
	for _, r := range rs.Rules {
		fmt.Fprintf(&b, "add rule inet %s %s %s\n", r.Table, r.Chain, r.Text)
	}
	return b.String()
}

// protoNumbers are the protocols a rule may name.
var protoNumbers = map[string]byte{"tcp": unix.IPPROTO_TCP, "udp": unix.IPPROTO_UDP}

type builder struct {
	fam   ruleset.Family
	text  []string
	exprs []expr.Any
	proto string
	// sets finds (and makes in the rule's table) the set a rule looks
	// up: by ipset name for "--match-set", by nft name for "@name".
	sets func(name string) (*Set, error)
}

func (b *builder) add(text string, e ...expr.Any) {
	b.text = append(b.text, text)
	b.exprs = append(b.exprs, e...)
}

func cmpOp(neg bool) (expr.CmpOp, string) {
	if neg {
		return expr.CmpOpNeq, "!= "
	}
	return expr.CmpOpEq, ""
}

func hostU32(v uint32) []byte {
	b := make([]byte, 4)
	binary.NativeEndian.PutUint32(b, v)
	return b
}

func be16(v uint16) []byte {
	b := make([]byte, 2)
	binary.BigEndian.PutUint16(b, v)
	return b
}

func parseNum(s string) (uint32, error) {
	n, err := strconv.ParseUint(s, 0, 32)
	return uint32(n), err
}

func ifname(name string) []byte {
	if strings.HasSuffix(name, "+") {
		return []byte(strings.TrimSuffix(name, "+"))
	}
	b := make([]byte, 16)
	copy(b, name)
	return b
}

// translate turns one rule's iptables arguments (the vocabulary package
// ruleset generates) into nftables expressions.
// setRef marks an interface argument that names a set of interface names
// (a run of rules merged): a ':' is in no Linux interface name, where an
// '@' may be, and such a name must match as itself.
const setRef = "set:"

func translate(fam ruleset.Family, args []string, sets func(string) (*Set, error)) (Rule, error) {
	b := &builder{fam: fam, sets: sets}
	nfproto, name := byte(unix.NFPROTO_IPV4), "ipv4"
	if fam == ruleset.IPv6 {
		nfproto, name = unix.NFPROTO_IPV6, "ipv6"
	}
	b.add("meta nfproto "+name,
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{nfproto}})
	neg := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		next := func() (string, error) {
			if i+1 >= len(args) {
				return "", fmt.Errorf("%s needs a value", a)
			}
			i++
			return args[i], nil
		}
		switch a {
		case "!":
			neg = true
			continue
		case "-p":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			proto := protoNumbers[v]
			if proto == 0 {
				return Rule{}, fmt.Errorf("unsupported protocol %q", v)
			}
			op, t := cmpOp(neg)
			b.proto = v
			b.add("meta l4proto "+t+v, &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: op, Register: 1, Data: []byte{proto}})
		case "-s", "-d":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			if err := b.addr(a == "-s", neg, v); err != nil {
				return Rule{}, err
			}
		case "-i", "-o":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			key, word := expr.MetaKeyIIFNAME, "iifname"
			if a == "-o" {
				key, word = expr.MetaKeyOIFNAME, "oifname"
			}
			if name, ok := strings.CutPrefix(v, setRef); ok {
				s, err := b.sets(name)
				if err != nil {
					return Rule{}, err
				}
				b.lookup(word, neg, s, &expr.Meta{Key: key, Register: 1})
				break
			}
			op, t := cmpOp(neg)
			txt := strings.TrimSuffix(v, "+")
			if strings.HasSuffix(v, "+") {
				txt += "*"
			}
			if strings.HasPrefix(txt, "@") {
				// Unquoted, nft would read a set's name.
				txt = `"` + txt + `"`
			}
			b.add(word+" "+t+txt, &expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: ifname(v)})
		case "--dport", "--sport":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			if err := b.port(a == "--sport", neg, v); err != nil {
				return Rule{}, err
			}
		case "--dports":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			if !neg {
				return Rule{}, fmt.Errorf("only negated port lists are supported")
			}
			for _, p := range strings.Split(v, ",") {
				if err := b.port(false, true, p); err != nil {
					return Rule{}, err
				}
			}
		case "--match-set":
			name, err := next()
			if err != nil {
				return Rule{}, err
			}
			dir, err := next()
			if err != nil {
				return Rule{}, err
			}
			if err := b.matchSet(neg, name, dir); err != nil {
				return Rule{}, err
			}
		case "-m":
			// Module names carry no match of their own here.
			if _, err := next(); err != nil {
				return Rule{}, err
			}
			continue
		case "--socket-exists":
			// nftables has no "a local socket exists", but loading the
			// socket's owner fails (the rule does not match) on a packet
			// without a full local socket: a comparison every uid passes
			// is that test. Forwarded traffic never has one.
			if neg {
				return Rule{}, errors.New("! --socket-exists is not supported")
			}
			b.add("skuid >= 0", &expr.Meta{Key: expr.MetaKeySKUID, Register: 1}, &expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: hostU32(0)})
		case "--uid-owner", "--gid-owner":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			id, err := parseNum(v)
			if err != nil {
				return Rule{}, err
			}
			key, word := expr.MetaKeySKUID, "skuid"
			if a == "--gid-owner" {
				key, word = expr.MetaKeySKGID, "skgid"
			}
			op, t := cmpOp(neg)
			b.add(word+" "+t+v, &expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: hostU32(id)})
		case "--mark":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			if err := b.mark(isConnmarkMatch(args), neg, v); err != nil {
				return Rule{}, err
			}
		case "--ctstate":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			var bits uint32
			var words []string
			for _, s := range strings.Split(v, ",") {
				bit, ok := map[string]uint32{"INVALID": expr.CtStateBitINVALID, "ESTABLISHED": expr.CtStateBitESTABLISHED,
					"RELATED": expr.CtStateBitRELATED, "NEW": expr.CtStateBitNEW}[s]
				if !ok {
					return Rule{}, fmt.Errorf("unsupported ctstate %q", s)
				}
				bits |= bit
				words = append(words, strings.ToLower(s))
			}
			b.add("ct state "+strings.Join(words, ","),
				&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: hostU32(bits), Xor: hostU32(0)},
				&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: hostU32(0)})
		case "-j":
			v, err := next()
			if err != nil {
				return Rule{}, err
			}
			if err := b.target(v, args[i+1:]); err != nil {
				return Rule{}, err
			}
			return Rule{Text: strings.Join(b.text, " "), Exprs: b.exprs}, nil
		default:
			return Rule{}, fmt.Errorf("unsupported option %q", a)
		}
		neg = false
	}
	return Rule{}, fmt.Errorf("rule without a target")
}

// mark compares the packet's or the connection's mark with a value, or,
// for "value/mask", only the mask's bits of it.
func (b *builder) mark(conn, neg bool, v string) error {
	val, mask, masked := strings.Cut(v, "/")
	m, err := parseNum(val)
	if err != nil {
		return fmt.Errorf("bad mark %q", v)
	}
	op, t := cmpOp(neg)
	load, word := expr.Any(&expr.Meta{Key: expr.MetaKeyMARK, Register: 1}), "meta mark "
	if conn {
		load, word = &expr.Ct{Key: expr.CtKeyMARK, Register: 1}, "ct mark "
	}
	if !masked {
		b.add(word+t+v, load, &expr.Cmp{Op: op, Register: 1, Data: hostU32(m)})
		return nil
	}
	bits, err := parseNum(mask)
	if err != nil {
		return fmt.Errorf("bad mark mask %q", v)
	}
	if t == "" {
		t = "== "
	}
	b.add(fmt.Sprintf("%s& %#x %s%#x", word, bits, t, m), load,
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: hostU32(bits), Xor: hostU32(0)},
		&expr.Cmp{Op: op, Register: 1, Data: hostU32(m & bits)})
	return nil
}

func isConnmarkMatch(args []string) bool {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-m" && args[i+1] == "connmark" {
			return true
		}
	}
	return false
}

func (b *builder) addr(src, neg bool, v string) error {
	p, err := netip.ParsePrefix(v)
	if err != nil {
		return err
	}
	if p.Addr().Is4() != (b.fam == ruleset.IPv4) {
		return fmt.Errorf("address %s does not belong to %s", v, b.fam)
	}
	off, word := uint32(16), "ip daddr"
	size := uint32(4)
	if b.fam == ruleset.IPv6 {
		off, word, size = 24, "ip6 daddr", 16
		if src {
			off, word = 8, "ip6 saddr"
		}
	} else if src {
		off, word = 12, "ip saddr"
	}
	op, t := cmpOp(neg)
	exprs := []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: size}}
	masked := p.Masked()
	if p.Bits() < p.Addr().BitLen() {
		mask := make([]byte, size)
		for i := 0; i < p.Bits(); i++ {
			mask[i/8] |= 0x80 >> (i % 8)
		}
		exprs = append(exprs, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: size, Mask: mask, Xor: make([]byte, size)})
	}
	exprs = append(exprs, &expr.Cmp{Op: op, Register: 1, Data: masked.Addr().AsSlice()})
	b.add(word+" "+t+p.String(), exprs...)
	return nil
}

func (b *builder) port(src, neg bool, v string) error {
	n, err := strconv.ParseUint(v, 10, 16)
	if err != nil {
		return fmt.Errorf("bad port %q", v)
	}
	if b.proto == "" {
		return fmt.Errorf("port match without a protocol")
	}
	off, word := uint32(2), "dport"
	if src {
		off, word = 0, "sport"
	}
	op, t := cmpOp(neg)
	b.add(b.proto+" "+word+" "+t+v,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
		&expr.Cmp{Op: op, Register: 1, Data: be16(uint16(n))})
	return nil
}

func (b *builder) target(t string, rest []string) error {
	opt := func(name string) (string, bool) {
		for i := 0; i+1 < len(rest); i++ {
			if rest[i] == name {
				return rest[i+1], true
			}
		}
		return "", false
	}
	counter := &expr.Counter{}
	switch t {
	case "RETURN":
		b.add("counter return", counter, &expr.Verdict{Kind: expr.VerdictReturn})
	case "ACCEPT":
		b.add("counter accept", counter, &expr.Verdict{Kind: expr.VerdictAccept})
	case "DROP":
		b.add("counter drop", counter, &expr.Verdict{Kind: expr.VerdictDrop})
	case "REDIRECT":
		v, ok := opt("--to-ports")
		if !ok {
			v, ok = opt("--to-port")
		}
		p, err := strconv.ParseUint(v, 10, 16)
		if !ok || err != nil {
			return fmt.Errorf("REDIRECT needs a port")
		}
		b.add("counter redirect to :"+v, counter,
			&expr.Immediate{Register: 1, Data: be16(uint16(p))},
			&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})
	case "TPROXY":
		port, ok := opt("--on-port")
		mark, ok2 := opt("--tproxy-mark")
		p, err := strconv.ParseUint(port, 10, 16)
		if !ok || !ok2 || err != nil {
			return fmt.Errorf("TPROXY needs --on-port and --tproxy-mark")
		}
		m, err := parseNum(strings.Split(mark, "/")[0])
		if err != nil {
			return err
		}
		fam := byte(unix.NFPROTO_IPV4)
		if b.fam == ruleset.IPv6 {
			fam = unix.NFPROTO_IPV6
		}
		b.add(fmt.Sprintf("counter meta mark set %d tproxy to :%s accept", m, port), counter,
			&expr.Immediate{Register: 1, Data: hostU32(m)},
			&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
			&expr.Immediate{Register: 1, Data: be16(uint16(p))},
			&expr.TProxy{Family: fam, TableFamily: unix.NFPROTO_INET, RegPort: 1},
			&expr.Verdict{Kind: expr.VerdictAccept})
	case "MARK":
		v, ok := opt("--set-mark")
		m, err := parseNum(v)
		if !ok || err != nil {
			return fmt.Errorf("MARK needs --set-mark")
		}
		b.add(fmt.Sprintf("counter meta mark set %d", m), counter,
			&expr.Immediate{Register: 1, Data: hostU32(m)},
			&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
	case "CONNMARK":
		switch {
		case len(rest) > 0 && rest[0] == "--save-mark":
			b.add("counter ct mark set meta mark", counter,
				&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
				&expr.Ct{Key: expr.CtKeyMARK, SourceRegister: true, Register: 1})
		case len(rest) > 1 && rest[0] == "--set-xmark":
			// The mask's bits of the connection's mark become the value's,
			// the others stay.
			val, mask, _ := strings.Cut(rest[1], "/")
			v, err := parseNum(val)
			if err != nil {
				return fmt.Errorf("bad CONNMARK value %q", rest[1])
			}
			m := uint32(0xffffffff)
			if mask != "" {
				if m, err = parseNum(mask); err != nil {
					return fmt.Errorf("bad CONNMARK mask %q", rest[1])
				}
			}
			b.add(fmt.Sprintf("counter ct mark set ct mark & %#x | %#x", ^m, v), counter,
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: hostU32(^m), Xor: hostU32(v)},
				&expr.Ct{Key: expr.CtKeyMARK, SourceRegister: true, Register: 1})
		case len(rest) > 0 && rest[0] == "--restore-mark":
			b.add("counter meta mark set ct mark", counter,
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
		default:
			return fmt.Errorf("unsupported CONNMARK %v", rest)
		}
	case "SNAT":
		v, ok := opt("--to-source")
		addr, err := netip.ParseAddr(v)
		if !ok || err != nil {
			return fmt.Errorf("SNAT needs an address in --to-source")
		}
		if addr.Is4() != (b.fam == ruleset.IPv4) {
			return fmt.Errorf("SNAT address %s does not belong to %s", v, b.fam)
		}
		fam := uint32(unix.NFPROTO_IPV4)
		if b.fam == ruleset.IPv6 {
			fam = unix.NFPROTO_IPV6
		}
		b.add("counter snat to "+v, counter,
			&expr.Immediate{Register: 1, Data: addr.AsSlice()},
			&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1, RegAddrMax: 1})
	case "CT":
		v, ok := opt("--zone")
		z, err := strconv.ParseUint(v, 10, 16)
		if !ok || err != nil {
			return fmt.Errorf("CT needs --zone")
		}
		zone := make([]byte, 2)
		binary.NativeEndian.PutUint16(zone, uint16(z))
		b.add("counter ct zone set "+v, counter,
			&expr.Immediate{Register: 1, Data: zone},
			&expr.Ct{Key: expr.CtKeyZONE, SourceRegister: true, Register: 1})
	default:
		if !strings.HasPrefix(t, ruleset.ChainPrefix) {
			return fmt.Errorf("unsupported target %q", t)
		}
		b.add("counter jump "+ChainName(t), counter, &expr.Verdict{Kind: expr.VerdictJump, Chain: ChainName(t)})
	}
	return nil
}
